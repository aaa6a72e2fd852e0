"""A plain TCP stream for peers' chunk pulls: the bytes of a session's KV, nothing else.

gRPC carries the control calls (FindPrefix, its lease), but not the bulk: through the
Python gRPC stack each chunk is copied about six times and pays per-message work on both
ends; on this project's 2-core machine a 2k-token fp32 history (50 MB) took ~0.35 s that
way while the serving engine computed beside it. Here the sender writes each sealed blob
from its DRAM copy straight to the socket, and the receiver reads it straight into the
engine's pool blocks and verifies it there: no user-space copy at all.

    request   u32 length | msgpack {"v": 1, "lease": str, "keys": [str, ...], "token": str}
    reply     per key, in order: u32 length | blob    (length 0xFFFFFFFF: not found)

One request per connection. ``token`` is the cluster's internal token
(``shared/internal_auth.py``): a server with a cluster secret closes the connection on a
request without it, before reading anything. The lease id (random, from FindPrefix)
names what the asker may read first; any key it names is read from the tiers like
GetChunks would. The asker reads each chunk straight into its pool blocks
(``engine_path/peer_load.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

import msgpack

from services.kvstore.store import TieredStore
from services.kvstore.store.checksum_work import sealed
from services.kvstore.tiers.base import Blob
from shared import internal_auth

log = logging.getLogger(__name__)

LEN = struct.Struct("<I")
MISSING = 0xFFFFFFFF
MAX_REQUEST_BYTES = 8 << 20
MAX_KEYS = 4096


def request_bytes(lease_id: str, keys: list[str]) -> bytes:
    """A pull request for ``keys`` under ``lease_id``, framed, with this process's token."""
    auth = internal_auth.current()
    body = msgpack.packb({"v": 1, "lease": lease_id, "keys": keys,
                          "token": auth.token if auth is not None else ""})
    return LEN.pack(len(body)) + body


class ChunkServer:
    """Serves chunk bytes to peers on ``host:port`` (0: a free port). ``held(lease_id)``
    gives the DRAM copies a FindPrefix lease holds."""

    def __init__(
        self,
        store: TieredStore,
        held: Callable[[str], dict[str, Blob]],
        host: str,
        port: int,
        chunk_delay_s: float = 0.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.store, self.held = store, held
        self.auth = internal_auth.current()  # (set at start-up, before any server)
        self.host, self.port = host, port
        self.chunk_delay_s = chunk_delay_s
        self.timeout_s = timeout_s  # a peer silent (or not reading) this long is dropped
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accept = asyncio.create_task(self._accept_loop(), name="chunk-server")
        return self.port

    async def close(self) -> None:
        for t in [self._accept, *self._conns]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._accept, *self._conns] if t is not None),
                             return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # out of descriptors, an aborted connection: keep serving
                log.warning("accepting a peer's chunk stream failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(self.timeout_s):
                n = LEN.unpack(await _recv_exactly(loop, conn, LEN.size))[0]
                if n > MAX_REQUEST_BYTES:
                    raise ValueError(f"a {n}-byte request")
                req = msgpack.unpackb(await _recv_exactly(loop, conn, n))
            if not isinstance(req, dict):
                raise ValueError("a malformed request")
            if self.auth is not None and not self.auth.accepts(req.get("token")):
                log.warning("refused a chunk stream request without the cluster's token")
                return
            keys, lease = req.get("keys"), req.get("lease", "")
            if (req.get("v") != 1 or not isinstance(keys, list) or len(keys) > MAX_KEYS
                    or not all(isinstance(k, str) for k in keys) or not isinstance(lease, str)):
                raise ValueError("a malformed request")
            held = self.held(lease)
            for key in keys:
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                kept = held.get(key)
                blob = await (sealed(kept) if kept is not None else self.store.get_blob(key))
                async with asyncio.timeout(self.timeout_s):  # a peer that stopped reading
                    if blob is None:
                        await loop.sock_sendall(conn, LEN.pack(MISSING))
                        continue
                    await loop.sock_sendall(conn, LEN.pack(len(blob)))
                    await loop.sock_sendall(conn, memoryview(blob))
        except (OSError, ValueError, msgpack.UnpackException, EOFError, TimeoutError) as e:
            log.info("a peer's chunk stream ended: %s", e)
        except Exception:
            log.exception("serving a peer's chunk stream failed")
        finally:
            conn.close()


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int
                        ) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("the peer closed the stream")
        got += k
    return buf
