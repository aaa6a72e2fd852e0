"""Instrumented tier calls: every read and write of the store goes through here.

Counts hits/misses, bytes in/out, evictions and errors per tier, and times each call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from services.kvstore.errors import TierUnavailable
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.tiers.base import Blob, Checked, Stored, T, Tier
from services.kvstore.tiers.dram import DramTier


class _TierCounters:
    """The labelled children of one tier, resolved once (``labels()`` is a locked lookup)."""

    def __init__(self, m: KVStoreMetrics, tier: str) -> None:
        self.hits = m.hits.labels(tier)
        self.misses = m.misses.labels(tier)
        self.bytes_in = m.bytes_in.labels(tier)
        self.bytes_out = m.bytes_out.labels(tier)
        self.evictions = m.evictions.labels(tier)
        self.get_s = m.latency.labels(tier, "get")
        self.put_s = m.latency.labels(tier, "put")
        self.get_err = m.tier_errors.labels(tier, "get")
        self.put_err = m.tier_errors.labels(tier, "put")


class TierIO:
    def __init__(self, metrics: KVStoreMetrics) -> None:
        self.m = metrics
        self._by_tier: dict[str, _TierCounters] = {}

    def _c(self, tier: Tier) -> _TierCounters:
        c = self._by_tier.get(tier.name)
        if c is None:
            c = self._by_tier[tier.name] = _TierCounters(self.m, tier.name)
        return c

    async def get(self, tier: Tier, key: str) -> Blob | None:
        """``tier.get`` with metrics; an unreachable tier counts as a miss (returns None)."""
        return (await self.get_many(tier, [key]))[0]

    async def get_many(self, tier: Tier, keys: list[str]) -> list[Blob | None]:
        """``tier.get_many`` with metrics (latency per batch); an unreachable tier is a
        miss for every key. ``ChunkCorrupt`` from the medium propagates."""
        c = self._c(tier)
        t0 = time.perf_counter()
        try:
            blobs = await tier.get_many(keys)
        except TierUnavailable:
            c.get_err.inc()
            blobs = [None] * len(keys)
        c.get_s.observe(time.perf_counter() - t0)
        self._count_reads(c, blobs)
        return blobs

    async def get_many_checked(
        self, tier: Tier, keys: list[str], check: Callable[[Stored], T]
    ) -> list[Checked[T]]:
        """``tier.get_many_checked`` with the metrics of ``get_many``."""
        c = self._c(tier)
        t0 = time.perf_counter()
        try:
            got = await tier.get_many_checked(keys, check)
        except TierUnavailable:
            c.get_err.inc()
            got = [None] * len(keys)
        c.get_s.observe(time.perf_counter() - t0)
        self._count_reads(c, [None if g is None else g[0].nbytes for g in got])
        return got

    @staticmethod
    def _count_reads(c: _TierCounters, reads: Sequence[Blob | int | None]) -> None:
        """Hits, misses and bytes of a batch: each read is the blob, its size, or None."""
        for r in reads:
            if r is None:
                c.misses.inc()
            else:
                c.hits.inc()
                c.bytes_out.inc(r if isinstance(r, int) else len(r))

    def dram_get_decoded(self, tier: DramTier, key: str, decode: Callable[[Blob], T]
                         ) -> tuple[Blob, T] | None:
        """``dram_get`` with the blob's decoded form, decoded once per stored blob."""
        c = self._c(tier)
        hit = tier.get_decoded(key, decode)
        if hit is None:
            c.misses.inc()
        else:
            c.hits.inc()
            c.bytes_out.inc(len(hit[0]))
        return hit

    def dram_get(self, tier: DramTier, key: str) -> Blob | None:
        """Synchronous DRAM read with metrics (no latency sample: there is no I/O to time)."""
        c = self._c(tier)
        blob = tier.get_now(key)
        if blob is None:
            c.misses.inc()
        else:
            c.hits.inc()
            c.bytes_out.inc(len(blob))
        return blob

    async def put(self, tier: Tier, key: str, blob: Blob, priority: int) -> list[str]:
        """``tier.put`` with metrics; re-raises ``TierUnavailable`` for the caller to retry.
        Returns the keys the tier evicted for it (``[key]``: too large, not stored)."""
        c = self._c(tier)
        t0 = time.perf_counter()
        try:
            evicted = await tier.put(key, blob, priority)
        except TierUnavailable:
            c.put_err.inc()
            raise
        finally:
            c.put_s.observe(time.perf_counter() - t0)
        self._account_put(tier, key, blob, evicted)
        return evicted

    def dram_put(self, tier: DramTier, key: str, blob: Blob, priority: int) -> None:
        """Synchronous DRAM insert (no await: the put has landed when this returns)."""
        self._account_put(tier, key, blob, tier.put_now(key, blob, priority))

    def _account_put(self, tier: Tier, key: str, blob: Blob, evicted: list[str]) -> None:
        c = self._c(tier)
        if key not in evicted:
            c.bytes_in.inc(len(blob))
        if evicted:
            c.evictions.inc(len(evicted))
