"""Expiry: local tiers drop entries idle past ``local_ttl_s``; the lowest tier past ``ttl_s``.

A session saved with a longer retention (``prompt_cache_retention``) keeps its entries in
the local tiers until it runs out (``retained``); a shorter one is expired by the
manifests' own retention sweep.

The lowest tier keeps everything until its TTL (DESIGN §3); DRAM and SSD also evict for
capacity on every put, so the sweep only bounds how long idle data lingers. The sweeper
works on the tiers and tells the durability ledger what the lowest tier loses; it knows
nothing of the store above them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from services.kvstore.errors import StorageError, TierUnavailable
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store.durability import DurabilityLedger
from services.kvstore.tiers.base import Tier

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(
        self,
        tiers: list[Tier],
        ledger: DurabilityLedger,
        metrics: KVStoreMetrics,
        local_ttl_s: float,
        ttl_s: float,
        retained: Callable[[float], Collection[str]] | None = None,
    ) -> None:
        self.tiers = tiers
        self.lowest = tiers[-1]
        self.ledger = ledger
        self.metrics = metrics
        self.local_ttl_s, self.ttl_s = local_ttl_s, ttl_s
        # The tier keys of sessions saved with a retention still running at a time: the
        # local tiers keep them past their idle TTL (manifests/retention.py).
        self.retained = retained

    async def sweep(self, now: float) -> int:
        """One pass over every tier; returns how many entries were removed."""
        removed = 0
        kept = self.retained(now) if self.retained is not None else ()
        for tier in self.tiers:
            ttl = self.ttl_s if tier is self.lowest else self.local_ttl_s
            try:
                for key in await tier.scan_expired(now - ttl):
                    if tier is not self.lowest:
                        if key in kept:
                            continue
                        removed += await self._expire(tier, key)
                        continue
                    removed += await self._expire_lowest(tier, key, now - ttl)
            except TierUnavailable as e:
                log.warning("sweep of %s skipped: %s", tier.name, e)
        return removed

    async def _expire_lowest(self, tier: Tier, key: str, older_than: float) -> int:
        # From the recheck to the delete, a manifest may not count on this chunk
        # (DurabilityLedger.durable_for_a_ttl), or it could name a chunk deleted next.
        self.ledger.sweeping.add(key)
        try:
            # The listing may be stale: a manifest write may have refreshed the chunk
            # since. Ask again.
            at = await tier.written_at(key)
            if at is not None and at >= older_than:
                return 0
            self.ledger.lost(key)
            return await self._expire(tier, key)
        finally:
            self.ledger.sweeping.discard(key)

    async def _expire(self, tier: Tier, key: str) -> int:
        if await tier.delete(key):
            self.metrics.expired.labels(tier.name).inc()
            return 1
        return 0


async def sweep_loop(
    sweep: Callable[[], Awaitable[int]],
    interval_s: float,
    idle_check: Callable[[], Awaitable[None]],
) -> None:
    """``sweep()`` every ``interval_s``; then ``idle_check()`` (invariants, debug only)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sweep()
            if log.isEnabledFor(logging.DEBUG):
                await idle_check()
        except StorageError as e:
            log.warning("sweep failed: %s", e)
