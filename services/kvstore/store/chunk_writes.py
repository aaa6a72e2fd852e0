"""The store's write path: a chunk lands in DRAM at once and is written behind below it.

    put / put_blob / put_encoded ──► DRAM now (the caller may reuse its memory)
                                 └─► WriteBehind: SSD, then the lowest tier ──► ack
                                       (the ledger vouches for the chunk once acked)

A chunk another node writes to the shared lowest tier (``copy_of_shared``) is written to
the local tiers only; ``write_down`` sends a chunk held here to the lowest tier alone (a
manifest found it missing there). A lowest tier that evicts for a write-behind put loses
those keys from the ledger, and one that cannot take the blob at all refuses it; a write
that lands after its chunk was deleted is deleted again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.kvstore.errors import WriteRefused
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store.checksum_work import checksum_work
from services.kvstore.store.chunk_reads import layer_priority
from services.kvstore.store.durability import DurabilityLedger
from services.kvstore.store.keys import CHUNK_PREFIX as _C
from services.kvstore.store.read_guard import ReadGuard
from services.kvstore.store.tier_io import TierIO
from services.kvstore.store.write_behind import WriteBehind
from services.kvstore.tiers.base import Blob, Tier
from services.kvstore.tiers.dram import DramTier
from shared.chunk_codec import ChunkMeta, parse_head, verify_chunk


@dataclass(slots=True)
class PutReceipt:
    key: str
    durable: asyncio.Future[None]  # resolves once the chunk is in the lowest tier


class ChunkWriter:
    """The write path of one store (see the module doc); ``behind`` is its queue."""

    def __init__(
        self,
        tiers: list[Tier],
        io: TierIO,
        guard: ReadGuard,
        ledger: DurabilityLedger,
        metrics: KVStoreMetrics,
        *,
        shared_lowest: bool,
        write_queue: int,
        write_workers: int,
        retry_backoff_max_s: float,
    ) -> None:
        """``shared_lowest``: the lowest tier is one every node writes (S3)."""
        assert isinstance(tiers[0], DramTier)
        self.dram: DramTier = tiers[0]
        self.lowest = tiers[-1]
        self.below_dram = tiers[1:]
        self.io = io
        self.guard = guard
        self.ledger = ledger
        self.shared_lowest = shared_lowest
        self.behind = WriteBehind(
            self._write_below, metrics, write_queue, write_workers,
            backoff_max_s=retry_backoff_max_s, undo=self._undo_write,
        )
        self._landed_fut: asyncio.Future[None] | None = None

    async def put_blob(self, blob: Blob, priority: int | None = None,
                       copy_of_shared: bool = False) -> PutReceipt:
        """A sealed chunk from outside, verified first (see ``TieredStore.put_blob``)."""
        await checksum_work(verify_chunk, blob)
        meta = parse_head(blob, len(blob)).meta
        return self.admit(
            meta.key, blob, layer_priority(meta.layer) if priority is None else priority,
            copy_of_shared,
        )

    def put_encoded(self, meta: ChunkMeta, blob: Blob, priority: int | None = None,
                    copy_of_shared: bool = False) -> PutReceipt:
        """A blob this process encoded as chunk ``meta``: trusted, no checksum."""
        prio = layer_priority(meta.layer) if priority is None else priority
        return self.admit(meta.key, blob, prio, copy_of_shared)

    def admit(self, key: str, blob: Blob, priority: int, copy_of_shared: bool = False
              ) -> PutReceipt:
        """Chunk ``key`` into DRAM now (no await), its writes below queued."""
        tier_key = _C + key
        self.guard.changed(tier_key)
        self.io.dram_put(self.dram, tier_key, blob, priority)
        # DRAM as the only tier: durable as it lands, its own index says so.
        self.ledger.landed_in_dram(key, dram_only=not self.below_dram)
        if not self.below_dram:
            return PutReceipt(key, self._landed())
        if copy_of_shared and self.shared_lowest:  # the ledger asks the lowest tier later
            return PutReceipt(key, self.behind.submit(tier_key, blob, priority,
                                                      self.below_dram[:-1], durable=False))
        return PutReceipt(key, self._write_behind(key, blob, priority, self.below_dram))

    def write_down(self, key: str, blob: Blob) -> asyncio.Future[None]:
        """Queue chunk ``key`` (``blob``, held here) for the lowest tier alone."""
        return self._write_behind(key, blob, layer_priority(int(key.rsplit("/", 1)[1])),
                                  [self.lowest])

    def _write_behind(self, key: str, blob: Blob, priority: int, targets: list[Tier]
                      ) -> asyncio.Future[None]:
        """Queue chunk ``key`` for ``targets`` (the lowest last); the ledger vouches for it
        once acknowledged, if nothing replaced or deleted it meanwhile."""
        fut = self.behind.submit(_C + key, blob, priority, targets, durable=True)
        self.ledger.begin_write(key, fut)
        return fut

    async def _write_below(self, tier: Tier, tier_key: str, blob: Blob, priority: int) -> None:
        """The write-behind's put: a lowest tier that evicts for it loses those keys (no
        more vouching for them), and one that cannot take the blob at all refuses it."""
        evicted = await self.io.put(tier, tier_key, blob, priority)
        if tier_key in evicted:
            raise WriteRefused(f"{tier_key} ({len(blob)} bytes) does not fit {tier.name}")
        if tier is self.lowest:
            for k in evicted:
                self.ledger.lost(k)

    async def _undo_write(self, tier: Tier, tkey: str) -> None:
        """A write-behind put that landed after its chunk was deleted: delete it again."""
        if tier is self.lowest:
            self.ledger.lost(tkey)
        await tier.delete(tkey)

    def _landed(self) -> asyncio.Future[None]:
        """A resolved future for receipts with nothing to wait for (one per loop: a put to
        a DRAM-only store should not pay for a future of its own)."""
        fut = self._landed_fut
        if fut is None or fut.get_loop() is not asyncio.get_running_loop():
            fut = self._landed_fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
        return fut
