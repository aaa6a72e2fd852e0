"""The store's read path: search the tiers in order, verify, promote, drop corrupt copies.

DRAM hits are trusted (the blob never left the process) and decoded without a checksum.
A lower tier's hits are checked where they are read (``get_many_checked``: inline or on
the reading thread); a corrupt copy is counted, deleted and the search goes on below; a
good one is promoted to DRAM (and to the tiers above it, in the background) unless a put
or delete of its key raced the read (``ReadGuard``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from services.kvstore.errors import TierUnavailable
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store.checksum_work import checksum_work
from services.kvstore.store.durability import DurabilityLedger
from services.kvstore.store.keys import CHUNK_PREFIX as _C
from services.kvstore.store.keys import chunk_of
from services.kvstore.store.read_guard import ReadGuard
from services.kvstore.store.tier_io import TierIO
from services.kvstore.store.write_behind import WriteBehind
from services.kvstore.tiers.base import Blob, Checked, Stored, Tier
from services.kvstore.tiers.dram import DramTier
from shared.chunk_codec import Chunk, ChunkCorrupt, decode_chunk, verify_chunk

log = logging.getLogger(__name__)


def decode_trusted(blob: Blob) -> Chunk:
    """A DRAM blob's chunk: trusted (it never left the process), so no checksum."""
    return decode_chunk(blob, verify=False)


def decode_stored(hit: Stored) -> Chunk:
    """The default check of a lower tier's hit: the whole blob, verified (its MAC, and
    that it is the chunk of the key it was stored under) and decoded."""
    return decode_chunk(hit.blob(), key=chunk_of(hit.key))


def layer_priority(layer: int) -> int:
    """Default eviction priority: later layers are evicted first (Symphony §3.3)."""
    return -layer


class ChunkReader:
    """The read path of one store (see the module doc)."""

    def __init__(
        self,
        tiers: list[Tier],
        io: TierIO,
        guard: ReadGuard,
        ledger: DurabilityLedger,
        writer: WriteBehind,
        metrics: KVStoreMetrics,
    ) -> None:
        self.tiers = tiers
        assert isinstance(tiers[0], DramTier)
        self.dram: DramTier = tiers[0]
        self.lowest = tiers[-1]
        self.io = io
        self.guard = guard
        self.ledger = ledger
        self.writer = writer
        self.metrics = metrics

    async def find_many(
        self, keys: list[str], check: Callable[[Stored], Chunk] | None = None
    ) -> list[tuple[Blob | None, Chunk | None, str]]:
        """(blob, chunk, tier name) per key, searching the tiers in order; ("" for a miss).
        DRAM hits are trusted and decoded without a checksum. A lower tier's hits are
        checked where they are read (``get_many_checked``); a corrupt one is deleted and
        the search goes on below; good ones are promoted if the check kept their blob
        (a check that read a chunk straight into place leaves none: blob None)."""
        check = check or decode_stored
        out: list[tuple[Blob | None, Chunk | None, str]] = [(None, None, "")] * len(keys)
        todo: list[int] = []
        for j, key in enumerate(keys):
            hit = self.io.dram_get_decoded(self.dram, _C + key, decode_trusted)
            if hit is not None:
                out[j] = (hit[0], hit[1], self.dram.name)
            else:
                todo.append(j)
        if not todo:
            return out
        with self.guard.reading([_C + keys[j] for j in todo]):
            await self._find_below(keys, todo, out, check)
        return out

    async def _find_below(self, keys: list[str], todo: list[int],
                          out: list[tuple[Blob | None, Chunk | None, str]],
                          check: Callable[[Stored], Chunk]) -> None:
        for i, tier in enumerate(self.tiers[1:], start=1):
            if not todo:
                break
            tkeys = [_C + keys[j] for j in todo]
            try:
                got = await self.io.get_many_checked(tier, tkeys, check)
            except ChunkCorrupt as e:  # the medium failed the batch: read one by one
                log.warning("%s reported corruption in a batch (%s); reading keys singly",
                            tier.name, e)
                got = [await self._get_one_checked(tier, k, check) for k in tkeys]
            missing = []
            for j, tkey, hit in zip(todo, tkeys, got, strict=True):
                if hit is None:
                    missing.append(j)
                    continue
                stored, chunk = hit
                if isinstance(chunk, ChunkCorrupt):
                    await self.drop_corrupt(tier, tkey, chunk, stored)
                    missing.append(j)
                    continue
                blob = stored.kept
                if blob is not None and self.guard.may_promote(tkey):
                    self.promote(tkey, blob, layer_priority(chunk.meta.layer), self.tiers[1:i])
                out[j] = (blob, chunk, tier.name)
            todo = missing

    async def _get_one_checked(
        self, tier: Tier, tkey: str, check: Callable[[Stored], Chunk]
    ) -> Checked[Chunk]:
        try:
            return (await self.io.get_many_checked(tier, [tkey], check))[0]
        except ChunkCorrupt as e:
            await self.drop_corrupt(tier, tkey, e)
            return None

    async def drop_corrupt(self, tier: Tier, tkey: str, err: ChunkCorrupt,
                           found: Stored | None = None) -> None:
        """Count and delete a corrupt copy (only ``found``, when given: a newer copy
        written since stays); the lowest tier's loss goes to the ledger."""
        log.warning("corrupt chunk %s in %s (%s): deleted, served as a miss", tkey, tier.name, err)
        self.metrics.checksum_failures.labels(tier.name).inc()
        if tier is self.lowest:
            self.ledger.lost(tkey)  # (a newer copy is asked for again: conservative)
        try:
            if found is None:
                await tier.delete(tkey)
            else:  # only that copy: a newer one written since stays
                await tier.delete_copy(tkey, found)
        except TierUnavailable as e:
            log.warning("could not delete corrupt %s from %s: %s", tkey, tier.name, e)

    async def local_copy(self, key: str) -> Blob | None:
        """Chunk ``key``'s blob from DRAM or a local tier above the lowest (checked), or None."""
        tkey = _C + key
        blob = self.dram.peek(tkey)
        for tier in self.tiers[1:-1]:
            if blob is not None:
                break
            try:
                blob = await self.io.get(tier, tkey)
                if blob is not None:
                    await checksum_work(functools.partial(verify_chunk, key=key), blob)
            except TierUnavailable:
                blob = None
            except ChunkCorrupt as e:
                await self.drop_corrupt(tier, tkey, e)
                blob = None
        return blob

    def promote(self, tkey: str, blob: Blob, priority: int, upper: list[Tier]) -> None:
        self.io.dram_put(self.dram, tkey, blob, priority)
        if upper:  # e.g. an S3 hit is also copied to SSD, in the background
            self.writer.submit(tkey, blob, priority, upper, durable=False)

