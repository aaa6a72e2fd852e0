"""The durability ledger: what the store vouches for in the lowest tier, and when it stops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.kvstore.errors import ManifestIncomplete, WriteDropped
from services.kvstore.manifests import ManifestStore
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import encode_chunk
from tests.unit.kvstore.chunks import (
    kv_tensor,
    meta,
    session_manifest,
)
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.stores import (
    GatedTier,
    make_store,
)


async def test_a_delete_during_the_write_behind_voids_its_durable_ack() -> None:
    """Deleted while its write to the lowest tier was in flight: the completing write
    must not make the store vouch for a chunk the lowest tier no longer has."""
    remote = GatedTier()
    async with make_store([DramTier(1 << 20), remote]) as s:
        m = meta("s", 0, 0)
        r = await s.put(m, kv_tensor(1))
        await asyncio.wait_for(remote.stored.wait(), 5)
        await s.delete(r.key)
        remote.gate.set()
        with pytest.raises(WriteDropped, match="deleted while"):
            await r.durable  # the write landed after the delete: it was undone
        assert not await remote.contains("c/" + r.key)
        assert not await s.ledger.is_durable(r.key)
        assert not s.has_local_or_durable(r.key)
        man = session_manifest("s", 1, 1, 1)  # names exactly chunk m
        assert man.chunk_keys() == [r.key]
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(man, wait_s=0.5)


async def test_a_queued_write_of_a_deleted_chunk_never_lands() -> None:
    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), remote]) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(2))
        await asyncio.sleep(0.05)  # queued for a retry
        await s.delete(r.key)
        remote.down = False
        with pytest.raises(WriteDropped):
            await r.durable
        await asyncio.sleep(0.1)
        assert not await remote.contains("c/" + r.key)
        s.check_integrity()


async def test_chunks_the_lowest_tier_evicts_are_no_longer_vouched_for(tmp_path: Path) -> None:
    """With SSD as the lowest tier, a chunk it evicts for room stops counting as durable,
    and the next save writes it again instead of skipping it."""
    blob_bytes = len(encode_chunk(meta("s", 0, 0), kv_tensor(0, tokens=64)))
    ssd = SsdTier(str(tmp_path / "db"), 2 * blob_bytes + blob_bytes // 2)
    async with make_store([DramTier(1 << 22), ssd]) as s:
        keys = []
        for i in range(3):
            r = await s.put(meta("s", i, 0), kv_tensor(i, tokens=64))
            await r.durable
            keys.append(r.key)
        assert not await ssd.contains("c/" + keys[0])  # evicted for the third
        assert keys[0] not in s.ledger._durable
        assert not s.has_local_or_durable(keys[0])  # still in DRAM, but must be saved again
        assert s.has_local_or_durable(keys[2])
        r = await s.put(meta("s", 0, 0), kv_tensor(0, tokens=64))
        await r.durable
        assert s.has_local_or_durable(keys[0])


async def test_a_dropped_write_is_written_again_by_the_next_save() -> None:
    """The queue was full and dropped a chunk's durable write: it is kept locally but no
    longer counts as stored, so the engine's next save of it goes through."""
    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), remote], write_queue=1) as s:
        first = await s.put(meta("s", 0, 0), kv_tensor(3), priority=0)
        await asyncio.sleep(0.05)
        second = await s.put(meta("s", 1, 0), kv_tensor(4), priority=5)
        with pytest.raises(WriteDropped):
            await first.durable
        await asyncio.sleep(0)
        assert s.dram.has_local("c/" + first.key)  # the local copy stays
        assert not s.has_local_or_durable(first.key)
        remote.down = False
        await second.durable
        again = await s.put(meta("s", 0, 0), kv_tensor(3))
        await again.durable
        assert s.has_local_or_durable(first.key) and await remote.contains("c/" + first.key)


async def test_an_unreachable_lowest_tier_never_keeps_chunks_from_the_ssd(tmp_path: Path) -> None:
    """Retries against a down lowest tier fill the bounded queue; fresh jobs still write
    their SSD copy first, and the drops fall on lowest-tier writes only."""
    class SlowToFail(FlakyTier):  # an unreachable endpoint takes a while to give up
        async def put(self, key: str, blob, priority: int = 0) -> list[str]:
            if self.down:
                await asyncio.sleep(0.02)
            return await super().put(key, blob, priority)

    remote = SlowToFail()
    remote.down = True
    async with make_store([DramTier(1 << 22), SsdTier(str(tmp_path / "db"), 1 << 24), remote],
                          write_queue=8, retry_backoff_max_s=0.01) as s:
        keys = []
        for i in range(60):  # later layers have lower priorities: the first to be dropped
            keys.append((await s.put(meta("s", i, i % 4), kv_tensor(i))).key)
            await asyncio.sleep(0.005)  # a steady stream, not one burst over the bound
        await asyncio.sleep(0.2)
        assert s.writer.dropped > 0  # the queue did overflow
        ssd = s.tiers[1]
        assert all(ssd.has_local("c/" + k) for k in keys)
        ok, detail = s.health()
        assert not ok and "dropped in the last" in detail
        assert s.writer.recent_drops(window_s=1e-9) == 0  # old drops leave the detail
        remote.down = False
