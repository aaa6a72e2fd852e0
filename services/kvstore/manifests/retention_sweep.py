"""Expiry of the sessions saved with a retention (``retention.RetentionIndex``): a pass
every sweep interval, at most ``SWEEP_BATCH`` sessions each, beside the tiers' own sweep."""

from __future__ import annotations

import asyncio
import logging
import time

from services.kvstore.errors import StorageError, TierUnavailable
from services.kvstore.manifests.manifest_store import ManifestStore
from services.kvstore.manifests.retention import RetentionIndex
from services.kvstore.store import TieredStore
from services.kvstore.store.keys import chunk_tier_key
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

# A save's chunks reach the tiers below DRAM after it (written behind): a clock there
# this little past the save is still the save's own write, not another session's read.
WRITE_BEHIND_SLACK_S = 30.0


async def retention_loop(manifests: ManifestStore, interval_s: float) -> None:
    """``sweep_retention`` every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sweep_retention(manifests, manifests.retention)
        except StorageError as e:
            log.warning("retention sweep failed: %s", e)


async def sweep_retention(
    manifests: ManifestStore, index: RetentionIndex, now: float | None = None
) -> int:
    """Expire the sessions whose retention ran out; the (key, tier) copies removed."""
    now = time.time() if now is None else now
    store = manifests.store
    removed = 0
    for m in index.expired(now):
        sid = SessionKey(m.tenant, m.session_id)
        if manifests.saves.running(sid):  # a turn is saving: its save decides (next pass)
            index.note(m)
            continue
        newer = await manifests.get_manifest(m.tenant, m.session_id)
        if newer is not None and newer.updated > m.updated:
            continue  # saved since on another node (a shared lowest tier): that one's
        await manifests.forget(m.tenant, m.session_id)
        removed += await manifests.delete_manifest(m.tenant, m.session_id)
        for key in m.chunk_keys():
            removed += await _delete_idle(store, chunk_tier_key(key), m.updated)
        store.metrics.sessions_expired.inc()
        log.info("session %s expired (retention %.0f s)", m.key, m.retain_s)
    return removed


async def _delete_idle(store: TieredStore, tkey: str, since: float) -> int:
    """Delete ``tkey`` unless it was read after ``since``; the lowest tier's copy only if no
    other node shares that tier. Reads land in DRAM (a hit below is promoted there), so
    DRAM's clock tells a read; the lower tiers' clocks also count this save's own writes
    behind, hence their slack."""
    lowest = store.lowest
    mine = [t for t in store.tiers if not (t is lowest and store.lowest_shared)]
    try:
        for tier in mine:
            at = await tier.written_at(tkey)
            slack = 0.0 if tier is store.dram else WRITE_BEHIND_SLACK_S
            if at is not None and at > since + slack:
                return 0
    except TierUnavailable as e:
        log.warning("retention: %s not deleted: %s", tkey, e)
        return 0
    local = [t.name for t in mine if t is not lowest]
    n = await store.delete_entry(tkey, local) if local else 0
    if lowest in mine:
        # as the Sweeper's: from the check to the delete no manifest counts on it
        store.ledger.sweeping.add(tkey)
        try:
            n += await store.delete_entry(tkey, [lowest.name])
        finally:
            store.ledger.sweeping.discard(tkey)
    return n
