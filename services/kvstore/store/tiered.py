"""TieredStore: chunks across DRAM → SSD → S3 (DESIGN §3): get, put, promote, evict.

Contract for callers (the gRPC service, the engine-pool path, the manifest store):

- ``put(meta, tensor)`` copies the tensor into a chunk blob and lands it in DRAM before
  its first await returns control: when ``put`` returns, the caller may reuse/unpin the
  source memory. The returned ``PutReceipt.durable`` future resolves once the chunk is in
  the lowest configured tier (fails with ``WriteDropped`` if the write-behind queue had to
  drop it). Awaiting it is optional.
- ``get(key)`` searches DRAM, then SSD, then S3; a hit in a lower tier is verified
  (checksum), promoted to DRAM (and SSD), and returned as a ``Chunk`` whose tensor views the
  stored blob (read-only; copy it into the pool). A miss, an unreachable tier and a corrupt
  copy all yield ``None`` (corrupt copies are counted and deleted).
- Safe for many concurrent callers on one event loop; not thread-safe.

The write path is ``chunk_writes.ChunkWriter``'s and the read path
``chunk_reads.ChunkReader``'s; this class composes them with the tiers' lifecycle, deletes,
presence checks and health. What is durable is the ``DurabilityLedger``'s business (the
store tells it about every write and loss); a read that raced a put or delete is kept from
promoting by the ``ReadGuard``; manifests live in ``manifests.ManifestStore`` over the same
tiers; expiry is the ``Sweeper``'s. ``ChunkMeta.block_hashes`` are the chained block
hashes of exactly the blocks in the chunk; the key uses the last one, so a prefix of a
session hits the same chunk keys as long as its chunks end on the same blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from services.kvstore.errors import TierUnavailable
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store.checksum_work import sealed
from services.kvstore.store.chunk_reads import (
    ChunkReader,
    decode_stored,
    decode_trusted,
    layer_priority,
)
from services.kvstore.store.chunk_writes import ChunkWriter, PutReceipt
from services.kvstore.store.durability import DurabilityLedger
from services.kvstore.store.keys import CHUNK_PREFIX as _C
from services.kvstore.store.keys import chunk_tier_key
from services.kvstore.store.read_guard import ReadGuard
from services.kvstore.store.sweeper import Sweeper, sweep_loop
from services.kvstore.store.tier_io import TierIO
from services.kvstore.store.write_behind import RECENT_DROPS_S
from services.kvstore.tiers.base import Blob, Stored, Tier, TierStats
from services.kvstore.tiers.dram import DramTier
from shared.chunk_codec import Chunk, ChunkMeta, encode_chunk

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
HEALTH_TICK_S = 1.0  # how often the tiers are asked (each decides whether to ask its medium)

__all__ = [
    "PutReceipt", "TieredStore", "chunk_tier_key", "decode_stored", "layer_priority",
]


class TieredStore:
    def __init__(
        self,
        tiers: list[Tier],
        metrics: KVStoreMetrics,
        *,
        write_queue: int = 1024,
        write_workers: int = 4,
        retry_backoff_max_s: float = 5.0,
        local_ttl_s: float = 86400.0,
        ttl_s: float = 7 * 86400.0,
        sweep_interval_s: float = 30.0,
        drain_s: float = 5.0,
    ) -> None:
        if not tiers or not isinstance(tiers[0], DramTier):
            raise ValueError("the first tier must be a DramTier")
        self.tiers = tiers
        self.dram: DramTier = tiers[0]
        self.lowest = tiers[-1]
        self.metrics = metrics
        self.io = TierIO(metrics)
        self.local_ttl_s, self.ttl_s = local_ttl_s, ttl_s
        self.sweep_interval_s, self.drain_s = sweep_interval_s, drain_s
        self.ledger = DurabilityLedger(self.lowest, ttl_s)
        self.guard = ReadGuard()
        self.writes = ChunkWriter(
            tiers, self.io, self.guard, self.ledger, metrics,
            shared_lowest=self.lowest_shared, write_queue=write_queue,
            write_workers=write_workers, retry_backoff_max_s=retry_backoff_max_s,
        )
        self.writer = self.writes.behind
        self.sweeper = Sweeper(tiers, self.ledger, metrics, local_ttl_s, ttl_s)
        self._sweep_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._opened: list[Tier] = []
        self.reader = ChunkReader(tiers, self.io, self.guard, self.ledger, self.writer, metrics)

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> TieredStore:
        try:
            for tier in self.tiers:
                await tier.open()
                self._opened.append(tier)
        except BaseException:
            await self._close_tiers()
            raise
        await self.writer.start()
        self._sweep_task = asyncio.create_task(
            sweep_loop(self.sweep, self.sweep_interval_s, self._check_when_idle),
            name="kv-sweeper",
        )
        self._health_task = asyncio.create_task(self._health_loop(), name="kv-tier-health")
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = [t for t in (self._sweep_task, self._health_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sweep_task = self._health_task = None
        await self.writer.close(self.drain_s)
        await self._close_tiers()

    async def _close_tiers(self) -> None:
        for tier in reversed(self._opened):
            try:
                await tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)
        self._opened = []

    @property
    def lowest_shared(self) -> bool:
        """Whether the lowest tier is one every node reaches (S3), not this node's own."""
        return len(self.tiers) > 1 and self.lowest.name == "s3"

    # ---------------------------------------------------------------- chunks

    async def put(
        self, meta: ChunkMeta, tensor: torch.Tensor, priority: int | None = None
    ) -> PutReceipt:
        """Encode ``tensor`` as chunk ``meta`` into DRAM now; write it behind. See module doc."""
        blob = encode_chunk(meta, tensor, seal=False)
        return self.writes.admit(
            meta.key, blob, layer_priority(meta.layer) if priority is None else priority
        )

    async def put_blob(self, blob: Blob, priority: int | None = None,
                       copy_of_shared: bool = False) -> PutReceipt:
        """Store an already encoded, sealed chunk (from a peer or a client); verifies it first.
        ``copy_of_shared`` as for ``put_encoded``.

        Raises ``ChunkCorrupt`` (nothing stored) if the blob fails its checksum or is not a
        well-formed chunk (its header is parsed as strictly as a read parses it, so nothing
        stored here can fail a later read for its form).
        """
        return await self.writes.put_blob(blob, priority, copy_of_shared)

    def put_encoded(
        self, meta: ChunkMeta, blob: bytearray, priority: int | None = None,
        copy_of_shared: bool = False,
    ) -> PutReceipt:
        """Admit a blob this process just built with ``encode_chunk(meta, t, seal=False)``.

        Synchronous (in DRAM when it returns), so heavy encoding can run on a worker thread
        first (the pool save path). The blob is trusted like a ``put``'s: no checksum.
        ``copy_of_shared``: a chunk another node writes to the shared lowest tier (this
        one loaded it from that node): written behind to the local tiers only (a manifest
        naming it asks the lowest tier, and writes it down from here if it is not there).
        """
        return self.writes.put_encoded(meta, blob, priority, copy_of_shared)

    def write_down(self, key: str, blob: Blob) -> asyncio.Future[None]:
        """Queue chunk ``key`` (``blob``, held here) for the lowest tier alone."""
        return self.writes.write_down(key, blob)

    async def get(self, key: str) -> Chunk | None:
        """The chunk under ``key`` or ``None`` (miss, unreachable or corrupt). See module doc."""
        if self.dram.has_local(_C + key):  # the common case, without the batch machinery
            hit = self.io.dram_get_decoded(self.dram, _C + key, decode_trusted)
            if hit is not None:
                return hit[1]
        return (await self.find_chunk(key))[0]

    async def find_chunk(self, key: str) -> tuple[Chunk | None, str]:
        """``get`` plus the name of the tier it came from ("" on a miss)."""
        return (await self.find_chunks([key]))[0]

    async def find_chunks(
        self, keys: list[str], check: Callable[[Stored], Chunk] | None = None
    ) -> list[tuple[Chunk | None, str]]:
        """``find_chunk`` for many keys, one batched read per tier (a layer's chunks).

        ``check`` turns a lower tier's hit into the chunk where it is read (inline or on
        the reading thread): it must verify the checksum (raising ``ChunkCorrupt``) as
        ``decode_chunk`` does, and may act on the chunk there (the pool load reads it
        straight into its pool blocks). DRAM hits are decoded on the loop without it.
        """
        return [(chunk, tier) for _blob, chunk, tier in await self.reader.find_many(keys, check)]

    async def get_blob(self, key: str) -> Blob | None:
        """The sealed blob under ``key`` (for sending to a peer) or ``None``."""
        blob, _chunk, _tier = (await self.reader.find_many([key]))[0]
        return await sealed(blob) if blob is not None else None

    def dram_blob(self, key: str) -> Blob | None:
        """The DRAM copy of chunk ``key`` (recency refreshed, no metrics: lookups)."""
        blob = self.dram.peek(_C + key)
        if blob is not None:
            self.dram.touch(_C + key)
        return blob

    def known_below_dram(self, key: str) -> Tier | None:
        """``first_tier_below_dram`` without I/O when the tier right below DRAM knows the
        key from its own index (the SSD's); None means "ask ``first_tier_below_dram``"."""
        if len(self.tiers) > 1 and self.tiers[1].has_local(_C + key):
            return self.tiers[1]
        return None

    async def first_tier_below_dram(self, key: str, last: int | None = None) -> Tier | None:
        """The fastest tier below DRAM holding chunk ``key`` (an unreachable tier is skipped),
        among ``tiers[1 : last + 1]`` (None: all of them)."""
        for tier in self.tiers[1 : None if last is None else last + 1]:
            try:
                if await tier.contains(_C + key):
                    return tier
            except TierUnavailable:
                continue
        return None

    def pin(self, tier: Tier, key: str) -> None:
        """Protect chunk ``key`` from ``tier``'s eviction and expiry (a prefix lease)."""
        tier.pin(_C + key)

    def unpin(self, tier: Tier, key: str) -> None:
        tier.unpin(_C + key)

    def has_local_or_durable(self, key: str) -> bool:
        """Whether chunk ``key`` is known stored without remote I/O: in DRAM, being written
        behind, or in a local tier's index, or acknowledged durable by this process."""
        tkey = _C + key
        vouched = self.ledger.vouches(key)  # False: its durable write was dropped
        if vouched is not None:
            return vouched
        return self.held_locally(tkey) or self.lowest.has_local(tkey)

    def held_locally(self, tkey: str) -> bool:
        """In DRAM or a local tier above the lowest (no I/O)."""
        return self.dram.peek(tkey) is not None or any(
            t.has_local(tkey) for t in self.tiers[1:-1])

    async def locate(self, key: str) -> list[str]:
        """Names of the tiers holding ``key`` (an unreachable tier is left out)."""
        out = []
        for tier in self.tiers:
            try:
                if await tier.contains(_C + key):
                    out.append(tier.name)
            except TierUnavailable:
                continue
        return out

    async def delete(self, key: str, tiers: Collection[str] = ()) -> int:
        """Delete ``key`` from ``tiers`` (names; empty = every tier); how many held it."""
        return await self.delete_entry(_C + key, tiers)

    def check_tier_names(self, names: Collection[str]) -> None:
        """Raise ``ValueError`` naming the known tiers if any name is not one of them."""
        known = [t.name for t in self.tiers]
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"unknown tier(s) {bad}; this kvstore has {known}")

    async def delete_entry(self, tkey: str, names: Collection[str] = ()) -> int:
        """Delete tier key ``tkey`` (a chunk's or a manifest's) from ``tiers``."""
        self.guard.changed(tkey)
        if not names or self.lowest.name in names:
            self.ledger.lost(tkey)
            self.writer.forget(tkey)  # a queued write would bring it back
        n = 0
        for tier in self.tiers:
            if names and tier.name not in names:
                continue
            try:
                n += bool(await tier.delete(tkey))
            except TierUnavailable as e:
                log.warning("delete of %s in %s failed: %s", tkey, tier.name, e)
        return n

    async def local_copy(self, key: str) -> Blob | None:
        """Chunk ``key``'s blob from DRAM or a local tier above the lowest (checked), or None."""
        return await self.reader.local_copy(key)

    # ---------------------------------------------------------------- expiry

    async def sweep(self, now: float | None = None) -> int:
        """One expiry pass (see ``Sweeper``); entries removed."""
        return await self.sweeper.sweep(time.time() if now is None else now)

    async def _check_when_idle(self) -> None:
        """The invariants hold between writes: check only when the write-behind is idle
        (and its last acks' callbacks have run)."""
        if await self.writer.wait_idle(0.1):
            await asyncio.sleep(0)
            self.check_integrity()

    # ---------------------------------------------------------------- status

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    async def _health_loop(self) -> None:
        """Every tier asked, each tick, whether it answers (``Tier.check_health``: a remote
        tier asks its endpoint only when it has not heard from it lately), so an outage
        shows in ``health()`` and the node's ``degraded`` while no request touches it."""
        while True:
            await asyncio.sleep(HEALTH_TICK_S)
            await asyncio.gather(*(t.check_health() for t in self.tiers))

    def health(self) -> tuple[bool, str]:
        """(healthy, detail): unhealthy tiers named, e.g. ``s3 degraded: ...``."""
        problems = [f"{s.name} degraded: {s.detail}" for s in self.stats() if not s.healthy]
        recent = self.writer.recent_drops()
        if recent:  # the lifetime count is in Status.dropped_writes and the metrics
            problems.append(f"{recent} write-behind jobs dropped in the last "
                            f"{RECENT_DROPS_S / 60:g} min")
        return (not any(not s.healthy for s in self.stats()), "; ".join(problems) or "ok")

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
        self.writer.check_integrity()
        self.ledger.check_integrity()
