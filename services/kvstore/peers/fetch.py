"""Stream a prefix leased on a peer into this node, lowest layer first.

Started as soon as the peer has answered the lookup, so the chunks are on the wire while
the engine plans and admits the request. Every chunk is verified where it lands (its
checksum, and its header against the block hashes the lookup matched) and put into this
node's DRAM (written behind like any chunk): the session now lives here too, and the
next turn on this node finds it locally. ``layer(l)`` hands the load the verified blobs
of layer ``l`` once all have arrived; if the stream breaks, stalls or delivers a bad
chunk, that layer and every later one fail (the engine recomputes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from services.kvstore import wire
from services.kvstore.errors import PeerFetchFailed
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.peers.links import PeerLinks
from services.kvstore.store import TieredStore
from services.kvstore.tiers.base import Blob
from shared.chunk_codec import ChunkCorrupt, ChunkFormatError, parse_head

log = logging.getLogger(__name__)


class PeerFetch:
    """Chunks ``keys[layer]`` (``expected[key]``: the block hashes each must carry) from
    the kvstore at ``peer`` under its lease ``peer_lease``. Event-loop only."""

    def __init__(
        self,
        store: TieredStore,
        links: PeerLinks,
        peer: str,
        peer_lease: str,
        keys: list[list[str]],
        expected: dict[str, tuple[bytes, ...]],
        timeout_s: float,
        window: int,
    ) -> None:
        self.store, self.links, self.peer = store, links, peer
        self.peer_lease = peer_lease
        self.keys = keys
        self.expected = expected
        self.timeout_s = timeout_s
        self.window = window
        self.blobs: dict[str, Blob] = {}
        self.failed_at: int | None = None  # first layer that will not arrive
        self.error = ""
        self.done_layers = 0
        self._events = [asyncio.Event() for _ in keys]
        self._task: asyncio.Task[None] | None = None

    @property
    def metrics(self) -> KVStoreMetrics:
        return self.store.metrics

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"peer-fetch-{self.peer}")

    async def layer(self, layer: int) -> dict[str, Blob]:
        """The verified blobs of ``layer`` (waits for them); raises ``PeerFetchFailed``."""
        await self._events[layer].wait()
        if self.failed_at is not None and layer >= self.failed_at:
            raise PeerFetchFailed(f"from peer {self.peer}: {self.error}")
        return {k: self.blobs[k] for k in self.keys[layer]}

    def close(self) -> None:
        """Stop pulling (the load is over or was never made) and end the peer's lease."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            self._fail(self.done_layers, "the pull was stopped")
        task = asyncio.get_running_loop().create_task(self._release())
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)

    async def _release(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # it expires on its own otherwise
            await self.links.stub(self.peer).ReleaseLease(
                wire.release_request(self.peer_lease), timeout=self.timeout_s)

    def _fail(self, layer: int, why: str) -> None:
        if self.failed_at is None or layer < self.failed_at:
            self.failed_at, self.error = layer, why
        for ev in self._events[layer:]:
            ev.set()

    async def _run(self) -> None:
        flat = [k for layer_keys in self.keys for k in layer_keys]
        log.info("pulling from peer %s: %d chunks in %d layers", self.peer, len(flat),
                 len(self.keys))
        t0 = time.perf_counter()
        nbytes = 0
        call = self.links.stub(self.peer).GetChunks(
            wire.keyed_chunks_request(flat, self.peer_lease, self.window))
        layer, left = 0, set(self.keys[0]) if self.keys else set()
        try:
            while layer < len(self.keys):
                try:
                    raw = await asyncio.wait_for(call.read(), self.timeout_s)
                except TimeoutError:
                    raise PeerFetchFailed(f"no chunk for {self.timeout_s:g} s") from None
                if raw is grpc.aio.EOF:
                    raise PeerFetchFailed("the stream ended early")
                msg = wire.chunk_from_pb(raw)
                if msg.key not in left:
                    raise PeerFetchFailed(f"an unasked or repeated chunk {msg.key[:120]}")
                if not msg.found:
                    raise PeerFetchFailed(f"chunk {msg.key[:120]} is gone from the peer")
                await self._keep(msg.key, msg.blob)
                nbytes += len(msg.blob)
                self.metrics.peer_bytes.labels(self.peer).inc(len(msg.blob))
                left.discard(msg.key)
                while not left and layer < len(self.keys):
                    self._events[layer].set()
                    self.done_layers = layer = layer + 1
                    left = set(self.keys[layer]) if layer < len(self.keys) else set()
            seconds = time.perf_counter() - t0
            self.links.observe(self.peer, nbytes, seconds)
            self.metrics.peer_pull_seconds.observe(seconds)
        except PeerFetchFailed as e:
            log.warning("pull from peer %s stopped at layer %d: %s", self.peer, layer, e)
            self._fail(layer, str(e))
        except grpc.aio.AioRpcError as e:
            log.warning("pull from peer %s stopped at layer %d: %s %s", self.peer, layer,
                        e.code().name, e.details())
            self._fail(layer, f"{e.code().name}: {e.details()}")
        except asyncio.CancelledError:
            self._fail(layer, "the pull was stopped")
            raise
        finally:
            call.cancel()

    async def _keep(self, key: str, blob: bytes) -> None:
        """Verify ``blob`` as chunk ``key`` with the expected hashes; keep it here."""
        try:
            receipt = await self.store.put_blob(blob)  # checksum first (ChunkCorrupt)
            ok = receipt.key == key and parse_head(blob, len(blob)).meta.block_hashes == \
                self.expected[key]
        except (ChunkCorrupt, ChunkFormatError) as e:
            self.metrics.checksum_failures.labels("peer").inc()
            raise PeerFetchFailed(f"chunk {key[:120]} is corrupt: {e}") from None
        if not ok:
            raise PeerFetchFailed(f"chunk {key[:120]} is not the one the lookup matched")
        self.blobs[key] = blob


_RELEASES: set[asyncio.Task[None]] = set()  # lease releases in flight (kept referenced)
