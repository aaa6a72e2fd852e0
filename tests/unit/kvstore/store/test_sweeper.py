"""Expiry: the sweep drops idle local entries and old lowest-tier ones, never under a manifest."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.kvstore.errors import ManifestIncomplete
from services.kvstore.manifests import ManifestStore
from services.kvstore.tiers import DramTier, SsdTier
from tests.unit.kvstore.chunks import (
    TENANT,
    kv_tensor,
    meta,
    session_chunks,
    session_manifest,
)
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.stores import (
    GatedRemote,
    make_store,
)


async def test_sweep_expires_idle_local_and_old_lowest(tmp_path: Path) -> None:
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)],
                          local_ttl_s=10, ttl_s=100) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(1))
        await r.durable
        assert await s.sweep(now=time.time() + 50) == 1  # DRAM idle > 10 s; SSD age < 100 s
        assert await s.dram.get("c/" + r.key) is None
        assert await s.sweep(now=time.time() + 200) == 1  # lowest tier past its TTL
        assert await s.get(r.key) is None
        assert s.metrics.value("kvstore_expired_total", tier="ssd") == 1


async def test_the_sweep_rechecks_a_stale_listing_before_deleting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    remote = FlakyTier()
    async with make_store([DramTier(1 << 20), remote], ttl_s=10.0) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(6))
        await r.durable

        async def stale(older_than: float) -> list[str]:  # listed before a refresh
            return ["c/" + r.key]

        monkeypatch.setattr(remote, "scan_expired", stale)
        assert await s.sweeper.sweep(time.time()) == 0
        assert await remote.contains("c/" + r.key)


async def test_the_sweep_and_a_manifest_never_leave_a_manifest_naming_a_deleted_chunk() -> None:
    """Sweep: recheck age, delete. A manifest checking the chunk in between (its refresh
    makes it young again) must not count on it: the sweep's delete is already decided."""
    remote = GatedRemote()
    async with make_store([DramTier(1 << 20), remote], ttl_s=0.2,
                          sweep_interval_s=3600) as s:
        m = session_manifest("s", 1, 1, 1)
        (cm, t), = session_chunks(m)
        r = await s.put(cm, t)
        remote.gate.set()
        await r.durable
        await s.dram.delete("c/" + r.key)  # so only the lowest tier is swept for it
        await asyncio.sleep(0.3)  # past the TTL
        remote.delete_gate.clear()
        sweep = asyncio.create_task(s.sweep())
        await remote.deleting.wait()  # decided: the chunk is expired, its delete is under way
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(m, wait_s=1)
        remote.delete_gate.set()
        assert await sweep >= 1
        assert await ManifestStore(s).get_manifest(TENANT, "s") is None


async def test_a_chunk_rewritten_while_the_sweep_deletes_it_is_not_vouched_for() -> None:
    """The sweep decided to delete an expired chunk; a save of the same chunk lands before
    the (slow) delete does. The store must not vouch for it afterwards."""

    class SlowDelete(FlakyTier):
        async def delete(self, key: str) -> bool:
            await asyncio.sleep(0.2)  # throttled and retried, say
            return await super().delete(key)

    remote = SlowDelete()
    async with make_store([DramTier(1 << 22), remote], ttl_s=100.0, sweep_interval_s=3600) as s:
        m = session_manifest("x", 1, 1, 1)
        (cm, t), = session_chunks(m)
        await (await s.put(cm, t)).durable
        sweep = asyncio.create_task(s.sweep(now=time.time() + 200))  # it looks expired
        await asyncio.sleep(0.05)  # the sweep is in its delete
        await (await s.put(cm, t)).durable  # lands before the delete
        assert await sweep >= 1
        assert not await remote.contains("c/" + cm.key)
        assert not await s.ledger.is_durable(cm.key)  # was vouched for from memory
        await ManifestStore(s).put_manifest(m, wait_s=2)  # writes the DRAM copy down again first
        assert await remote.contains("c/" + cm.key)
