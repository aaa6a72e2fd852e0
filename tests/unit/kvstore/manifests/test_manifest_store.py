"""The manifest store: a manifest is written only once every chunk it names is durable."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch

from services.kvstore.errors import ManifestIncomplete, TierUnavailable
from services.kvstore.manifests import ManifestStore
from services.kvstore.streaming import stream_session
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import decode_chunk
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
    wait_durable_from_scratch,
)


async def test_manifest_only_after_chunks_are_durable() -> None:
    remote = FlakyTier()
    async with make_store([DramTier(1 << 20), remote]) as s:
        m = session_manifest("sess", num_blocks=5, num_layers=2, bpc=2)
        chunks = session_chunks(m)
        assert len(chunks) == 6  # 3 chunks per layer x 2 layers
        remote.down = True
        receipts = [await s.put(cm, t) for cm, t in chunks[:-1]]
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(m)  # last chunk never put
        await s.put(*chunks[-1])
        with pytest.raises(ManifestIncomplete, match="not durable after"):
            await ManifestStore(s).put_manifest(m, wait_s=0.05)  # all put, none durable yet
        assert await ManifestStore(s).get_manifest("t1", "sess") is None
        remote.down = False
        await ManifestStore(s).put_manifest(m)  # waits for the in-flight writes
        assert all(r.durable.done() for r in receipts)
        got = await ManifestStore(s).get_manifest("t1", "sess")
        assert got == m
        layer1 = await ManifestStore(s).get_layer(m, 1)
        assert [
            torch.equal(c.tensor, t) for c, (_cm, t) in zip(layer1, chunks[3:], strict=False)
        ] == [True] * 3


async def test_stream_session_is_lowest_layer_first_with_misses() -> None:
    async with make_store([DramTier(1 << 20)]) as s:
        m = session_manifest("sess", num_blocks=4, num_layers=3, bpc=2)
        chunks = session_chunks(m)
        for cm, t in chunks:
            await s.put(cm, t)
        await s.delete(chunks[3][0].key)  # layer 1, chunk 1
        seen = [
            (layer, i, blob is not None)
            async for layer, i, _k, blob in stream_session(s, m, window=2)
        ]
        assert seen == [
            (0, 0, True),
            (0, 1, True),
            (1, 0, True),
            (1, 1, False),
            (2, 0, True),
            (2, 1, True),
        ]
        first = [x async for x in stream_session(s, m, first_layer=2)]
        assert [(x[0], x[1]) for x in first] == [(2, 0), (2, 1)]
        decode_chunk(first[0][3])  # blobs handed out are sealed and verify


async def test_manifest_refused_after_a_named_chunk_was_deleted() -> None:
    async with make_store([DramTier(1 << 20), FlakyTier()]) as s:
        m = session_manifest("gone", num_blocks=2, num_layers=2, bpc=2)
        for cm, t in session_chunks(m):
            await (await s.put(cm, t)).durable
        await s.delete(m.chunk_keys()[1])
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(m)
        s.check_integrity()


async def test_a_manifest_refreshes_chunks_past_half_their_ttl() -> None:
    """A session's manifest names chunks of its first turns too: one older than half the
    lowest tier's TTL gets its clock restarted before the manifest is written, so the
    sweep does not expire it from under the manifest."""

    remote = FlakyTier()
    async with make_store([DramTier(1 << 20), remote], ttl_s=10.0) as s:
        m = meta("s", 0, 0)
        r = await s.put(m, kv_tensor(5))
        await r.durable
        now = time.time()
        remote._index.get("c/" + r.key).touched = now - 6  # written 6 s ago
        s.ledger._durable[r.key] = now - 6
        await ManifestStore(s).put_manifest(session_manifest("s", 1, 1, 1))
        assert (await remote.written_at("c/" + r.key)) >= now  # refreshed
        await s.sweeper.sweep(now + 5)  # the old clock would have expired it here
        assert await remote.contains("c/" + r.key)
        assert await ManifestStore(s).get_manifest(TENANT, "s") is not None


async def test_a_chunk_deleted_while_its_write_is_in_flight_blocks_its_manifest() -> None:
    """The write completes after the delete: its ack must not let a manifest name it."""
    remote = GatedRemote()
    async with make_store([DramTier(1 << 20), remote]) as s:
        m = session_manifest("s", 1, 1, 1)
        ((cm, t),) = session_chunks(m)
        r = await s.put(cm, t)
        await remote.stored.wait()  # in the lowest tier, the put not answered yet
        manifest = asyncio.create_task(ManifestStore(s).put_manifest(m, wait_s=5))
        await asyncio.sleep(0.05)
        assert await s.delete(r.key) == 2
        remote.gate.set()
        with pytest.raises(ManifestIncomplete):
            await manifest
        assert await ManifestStore(s).get_manifest(TENANT, "s") is None
        assert not await s.ledger.is_durable(r.key)


async def test_chunks_held_locally_but_never_written_down_are_rewritten_for_a_manifest(
    tmp_path: Path,
) -> None:
    """A restart forgets which chunks were still to be written to the lowest tier: the
    SSD has them, so saves skip them. The manifest writes them down from the SSD copy."""
    remote = FlakyTier()
    remote.down = True
    m = session_manifest("s", 4, 2, 1)
    async with make_store(
        [DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote], drain_s=0.2
    ) as s:
        for cm, t in session_chunks(m):
            await s.put(cm, t)
        await asyncio.sleep(0.3)  # on SSD; the lowest tier refuses every write
    remote.down = False
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote]) as s:
        assert all(s.has_local_or_durable(cm.key) for cm, _ in session_chunks(m))
        keys = ["c/" + cm.key for cm, _ in session_chunks(m)]
        assert not any([await remote.contains(k) for k in keys])
        await ManifestStore(s).put_manifest(m, wait_s=5)
        assert all([await remote.contains(k) for k in keys])
        assert (await ManifestStore(s).get_manifest(TENANT, "s")) is not None
        s.check_integrity()


async def test_no_rewrite_while_the_lowest_tier_is_down(tmp_path: Path) -> None:
    remote = FlakyTier()
    m = session_manifest("s", 2, 1, 1)
    async with make_store(
        [DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote], write_queue=2
    ) as s:
        remote.down = True
        for cm, t in session_chunks(m):
            await s.put(cm, t)
        depth = s.writer.depth
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(m, wait_s=0.1)
        assert s.writer.depth <= depth  # nothing queued again to churn against an outage
        remote.down = False


async def test_a_chunk_deleted_while_its_copy_is_read_for_a_rewrite_stays_deleted(
    tmp_path: Path,
) -> None:
    """The rewrite reads the SSD copy, awaiting; a delete lands meanwhile: the copy read
    must not bring the chunk back in the lowest tier."""

    class SlowSsd(SsdTier):
        gate: asyncio.Event | None = None
        reading = asyncio.Event()

        async def get_many(self, keys: list[str]):
            blobs = await super().get_many(keys)
            if self.gate is not None:
                self.reading.set()
                await self.gate.wait()
            return blobs

    remote = FlakyTier()
    m = session_manifest("s", 1, 1, 1)
    ((cm, t),) = session_chunks(m)
    ssd = SlowSsd(str(tmp_path / "db"), 1 << 20)
    async with make_store([DramTier(1 << 20), ssd, remote]) as s:
        await (await s.put(cm, t)).durable
        await remote.delete("c/" + cm.key)  # lost below (as after an outage and a restart)
        s.ledger.lost("c/" + cm.key)
        await s.dram.delete("c/" + cm.key)  # so the copy comes from the SSD
        ssd.gate = asyncio.Event()
        manifest = asyncio.create_task(ManifestStore(s).put_manifest(m, wait_s=1))
        await asyncio.wait_for(ssd.reading.wait(), 5)
        await s.delete(cm.key)
        ssd.gate.set()
        with pytest.raises(ManifestIncomplete):
            await manifest
        await s.writer.wait_idle(5)
        assert not await remote.contains("c/" + cm.key)


async def test_chunks_a_degraded_tier_would_not_answer_for_are_not_written_again() -> None:
    """After a restart nothing is vouched for: a manifest asks the lowest tier for every
    chunk at once. If that tier is a circuit breaker just due for its probe, all but the
    probe are refused; once the probe heals it they are asked again, not rewritten."""

    class Breaker(FlakyTier):
        tripped = probing = False

        async def written_at(self, key: str) -> float | None:
            if self.tripped:
                if self.probing:
                    raise TierUnavailable("breaker open")
                self.probing = True
                await asyncio.sleep(0.01)
                self.tripped = self.probing = False
            return await super().written_at(key)

        def stats(self):
            st = super().stats()
            return dataclasses.replace(st, healthy=st.healthy and not self.tripped)

    remote = Breaker()
    m = session_manifest("x", 8, 2, 2)
    async with make_store([DramTier(1 << 22), remote]) as s:
        for cm, t in session_chunks(m):
            await (await s.put(cm, t)).durable
    puts = remote.puts
    async with make_store([DramTier(1 << 22), remote]) as s:  # a new process
        remote.tripped = True
        await ManifestStore(s).put_manifest(m, wait_s=2)
        assert remote.puts == puts + 1  # the manifest only: no chunk written again
        remote.down = True  # a lowest tier that does not answer at all: no rewrite either
        with pytest.raises(ManifestIncomplete, match="did not answer"):
            await wait_durable_from_scratch(s, m)
        remote.down = False


async def test_a_prefetched_session_is_adopted_only_when_still_wanted() -> None:
    async with make_store([DramTier(1 << 20)]) as s:
        ms = ManifestStore(s)
        short = session_manifest("sess", num_blocks=3, num_layers=2, bpc=2)
        long = session_manifest("sess", num_blocks=5, num_layers=2, bpc=2)
        mark = ms.deletions(TENANT, "sess")
        assert await ms.newest_manifest(TENANT, "sess") is None
        assert ms.adopt(long, mark)  # lookups here now know the sequence ...
        assert ms.latest(TENANT, "sess").token_count == long.token_count
        assert await ms.newest_manifest(TENANT, "sess") == long  # ... and peers get it
        assert not ms.adopt(short, mark)  # an older (shorter) copy arriving late: ignored
        assert ms.latest(TENANT, "sess").token_count == long.token_count
        await ms.forget(TENANT, "sess")  # deleted while a copy was on its way
        assert not ms.adopt(long, mark)
        assert ms.latest(TENANT, "sess") is None
        assert await ms.newest_manifest(TENANT, "sess") is None
