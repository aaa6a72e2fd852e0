"""Expiry: local tiers drop entries idle past ``local_ttl_s``; the lowest tier past ``ttl_s``.

The lowest tier keeps everything until its TTL (DESIGN §3); DRAM and SSD also evict for
capacity on every put, so the sweep only bounds how long idle data lingers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.kvstore.errors import StorageError, TierUnavailable

if TYPE_CHECKING:
    from services.kvstore.store import TieredStore
    from services.kvstore.tiers.base import Tier

log = logging.getLogger(__name__)


async def sweep_tiers(store: TieredStore, now: float) -> int:
    """One pass over every tier; returns how many entries were removed."""
    removed = 0
    for tier in store.tiers:
        ttl = store.ttl_s if tier is store.lowest else store.local_ttl_s
        try:
            for key in await tier.scan_expired(now - ttl):
                if tier is not store.lowest:
                    removed += await _expire(store, tier, key)
                    continue
                # From the recheck to the delete, a manifest may not count on this chunk
                # (TieredStore._durable_for_a_ttl), or it could name a chunk deleted next.
                store.sweeping.add(key)
                try:
                    # The listing may be stale: a manifest write may have refreshed the
                    # chunk since. Ask again.
                    at = await tier.written_at(key)
                    if at is not None and at >= now - ttl:
                        continue
                    store.forget_durable(key)
                    removed += await _expire(store, tier, key)
                finally:
                    store.sweeping.discard(key)
        except TierUnavailable as e:
            log.warning("sweep of %s skipped: %s", tier.name, e)
    return removed


async def _expire(store: TieredStore, tier: Tier, key: str) -> int:
    if await tier.delete(key):
        store.metrics.expired.labels(tier.name).inc()
        return 1
    return 0


async def sweep_loop(store: TieredStore) -> None:
    """Sweep every ``store.sweep_interval_s``; checks invariants when debug logging is on."""
    while True:
        await asyncio.sleep(store.sweep_interval_s)
        try:
            await store.sweep()
            # The invariants hold between writes: check only when the write-behind is idle
            # (and its last acks' callbacks have run).
            if log.isEnabledFor(logging.DEBUG) and await store.writer.wait_idle(0.1):
                await asyncio.sleep(0)
                store.check_integrity()
        except StorageError as e:
            log.warning("sweep failed: %s", e)
