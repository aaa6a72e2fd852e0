"""A prefix leased on a peer, streamed in over its TCP data port, lowest layer first.

The connection opens and the request goes out as soon as the peer has answered the
lookup, so the first chunks are on the wire (the peer's socket buffers fill, then it
waits) while the engine plans and admits the request. The load then reads each layer's
chunks off the stream straight into their pool blocks (``engine_path/peer_load.py``): no
buffer in between, whose fresh pages alone cost a 2k-token history ~0.1 s of page
faults here. If the stream breaks, stalls or delivers a chunk that fails its checks,
that layer and every later one fail (the engine recomputes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import grpc

from services.kvstore import wire
from services.kvstore.errors import PeerFetchFailed
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.peers.data_plane import LEN, MISSING, request_bytes
from services.kvstore.peers.links import PeerLinks

log = logging.getLogger(__name__)


class PeerFetch:
    """Chunks ``keys[layer]`` (``expected[key]``: the block hashes each must carry) from
    the kvstore at ``peer`` (its data port ``data_port``) under its lease ``peer_lease``.
    Event-loop only; layers are read in order, each once."""

    def __init__(
        self,
        metrics: KVStoreMetrics,
        links: PeerLinks,
        peer: str,
        peer_lease: str,
        keys: list[list[str]],
        expected: dict[str, tuple[bytes, ...]],
        timeout_s: float,
        data_port: int,
    ) -> None:
        self.metrics, self.links, self.peer = metrics, links, peer
        self.peer_lease = peer_lease
        self.keys = keys
        self.expected = expected
        self.timeout_s = timeout_s
        self.data_port = data_port
        self.next_layer = 0
        self.error = ""
        self.nbytes = 0
        self.read_s = 0.0  # time spent receiving (the link's rate; not the load's pace)
        self._sock: socket.socket | None = None
        self._opening: asyncio.Task[None] | None = None
        self._advanced = asyncio.Event()  # set (and renewed) when a layer is done or it fails
        self._closed = False

    def start(self) -> None:
        log.info("pulling from peer %s: %d chunks in %d layers", self.peer,
                 sum(len(k) for k in self.keys), len(self.keys))
        self._opening = asyncio.create_task(self._open(), name=f"peer-pull-{self.peer}")
        # A connect that fails before any load asks (or with none coming) is not an error
        # to log from the task: the load that asks reports it, as a failed layer.
        self._opening.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _open(self) -> None:
        """Connect and send the request; the socket is ours only once that is done (a
        cancelled open closes its own socket: nothing else may close one with an operation
        pending on it)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            host = self.peer.rsplit(":", 1)[0].strip("[]")
            flat = [k for layer_keys in self.keys for k in layer_keys]
            await loop.sock_connect(sock, (host, self.data_port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_sendall(sock, request_bytes(self.peer_lease, flat))
        except BaseException:
            sock.close()
            raise
        if self._closed or self.error:
            sock.close()
        else:
            self._sock = sock

    async def begin_layer(self, layer: int) -> None:
        """Wait until the stream is at ``layer``'s first chunk (the layers before it were
        read); raises ``PeerFetchFailed``."""
        while self.next_layer < layer and not self.error:
            await self._advanced.wait()
        if self.error:
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}")
        if layer != self.next_layer:
            self.fail(f"layer {layer} asked for after layer {self.next_layer - 1}")
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}")
        opening = self._opening
        assert opening is not None
        try:
            await asyncio.wait_for(asyncio.shield(opening), self.timeout_s)
        except asyncio.CancelledError:
            if not opening.cancelled():
                raise  # this load was cancelled
            self.fail("the pull was stopped")
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}") from None
        except Exception as e:  # unreachable, refused, a port that is no port...
            self.fail(f"could not open the stream: {e!r}")
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}") from None
        if self._sock is None:
            raise PeerFetchFailed(f"from peer {self.peer}: the stream is closed "
                                  f"({self.error or 'the pull was stopped'})")

    async def chunk_length(self, key: str) -> int:
        """The next chunk's length; raises ``PeerFetchFailed`` if the peer no longer has it."""
        buf = bytearray(LEN.size)
        await self.recv_into([memoryview(buf)])
        n = LEN.unpack(buf)[0]
        if n == MISSING:
            self.fail(f"chunk {key[:120]} is gone from the peer")
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}")
        return int(n)

    async def recv_into(self, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` in order from the stream; no data for ``timeout_s`` or a closed
        stream raises ``PeerFetchFailed``."""
        loop = asyncio.get_running_loop()
        sock = self._sock
        if sock is None:
            raise PeerFetchFailed(f"from peer {self.peer}: the stream is closed "
                                  f"({self.error or 'the pull was stopped'})")
        t0 = time.perf_counter()
        try:
            for buf in bufs:
                got = 0
                while got < len(buf):
                    async with asyncio.timeout(self.timeout_s):
                        k = await loop.sock_recv_into(sock, buf[got:])
                    if k == 0:
                        raise EOFError("the peer closed the stream")
                    got += k
        except (OSError, EOFError, TimeoutError) as e:
            why = f"no data for {self.timeout_s:g} s" if isinstance(e, TimeoutError) else e
            self.fail(f"the stream broke: {why}")
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}") from None
        self.read_s += time.perf_counter() - t0
        n = sum(len(b) for b in bufs)
        self.nbytes += n
        self.metrics.peer_bytes.labels(self.peer).inc(n)

    def end_layer(self, layer: int) -> None:
        self.next_layer = layer + 1
        self._wake()
        if self.next_layer == len(self.keys):
            log.info("pulled %.1f MB from peer %s, %.3f s receiving (%.0f MB/s)",
                     self.nbytes / 1e6, self.peer, self.read_s,
                     self.nbytes / 1e6 / max(self.read_s, 1e-9))
            self.links.observe(self.peer, self.nbytes, self.read_s)
            self.metrics.peer_pull_seconds.observe(self.read_s)
            self._close_socket()

    def fail(self, why: str) -> None:
        if not self.error:
            self.error = why
            log.warning("pull from peer %s stopped at layer %d: %s", self.peer,
                        self.next_layer, why)
        self._close_socket()
        self._wake()

    def _wake(self) -> None:
        self._advanced.set()
        self._advanced = asyncio.Event()

    def _close_socket(self) -> None:
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()  # (it closes its own socket)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Stop pulling (the load is over or was never made) and end the peer's lease."""
        if self._closed:
            return
        self._closed = True
        self._close_socket()
        task = asyncio.get_running_loop().create_task(self._release())
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)

    async def _release(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # it expires on its own otherwise
            await self.links.stub(self.peer).ReleaseLease(
                wire.release_request(self.peer_lease), timeout=self.timeout_s)


_RELEASES: set[asyncio.Task[None]] = set()  # lease releases in flight (kept referenced)
