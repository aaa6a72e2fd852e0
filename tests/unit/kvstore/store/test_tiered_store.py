"""The chunk store: puts land in DRAM, reads search the tiers, verify and promote, and
corrupt copies are dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import ChunkCorrupt, decode_chunk, encode_chunk, seal_chunk
from tests.unit.kvstore.chunks import (
    forged_chunk,
    kv_tensor,
    meta,
)
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.stores import (
    make_store,
    version,
)
from tests.unit.kvstore.tier_faults import overwrite


async def test_put_lands_in_dram_before_returning_and_acks_durable(tmp_path: Path) -> None:
    remote = FlakyTier()
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote]) as s:
        src = kv_tensor(1)
        r = await s.put(meta("s", 0, 0), src)
        src.zero_()  # the caller may reuse its memory at once
        assert await s.dram.contains("c/" + r.key)
        await r.durable
        assert await remote.contains("c/" + r.key)
        assert await s.tiers[1].contains("c/" + r.key)  # SSD written before the lowest tier
        c = await s.get(r.key)
        assert c is not None and torch.equal(c.tensor, kv_tensor(1))
        assert s.metrics.value("kvstore_durable_writes_total") == 1
        s.check_integrity()


async def test_dram_hits_decode_once_and_never_serve_a_replaced_blob() -> None:
    """A DRAM hit reuses the chunk decoded at the first hit; replacing, evicting or
    deleting the blob drops it, so a get never returns stale data."""
    blob_bytes = len(encode_chunk(meta("s", 0, 0), kv_tensor(1)))
    async with make_store([DramTier(2 * blob_bytes)]) as s:
        a, b = meta("s", 0, 0), meta("s", 1, 0)
        await s.put(a, kv_tensor(1))
        first = await s.get(a.key)
        assert first is not None and await s.get(a.key) is first  # decoded once
        await s.put(a, kv_tensor(2))  # replaced
        got = await s.get(a.key)
        assert got is not None and torch.equal(got.tensor, kv_tensor(2))
        await s.put(b, kv_tensor(3))
        await s.put(meta("s", 2, 0), kv_tensor(4))  # evicts a, the least recently used
        assert await s.get(a.key) is None
        await s.put(a, kv_tensor(5))
        got = await s.get(a.key)
        assert got is not None and torch.equal(got.tensor, kv_tensor(5))
        assert s.metrics.value("kvstore_hits_total", tier="dram") == 4
        assert s.metrics.value("kvstore_misses_total", tier="dram") == 1
        s.check_integrity()


async def test_get_promotes_from_lower_tiers(tmp_path: Path) -> None:
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)]) as s:
        r = await s.put(meta("s", 0, 2), kv_tensor(7))
        await r.durable
        await s.dram.delete("c/" + r.key)
        c = await s.get(r.key)
        assert c is not None and torch.equal(c.tensor, kv_tensor(7))
        assert await s.dram.contains("c/" + r.key)
        assert s.metrics.value("kvstore_hits_total", tier="ssd") == 1
        assert s.metrics.value("kvstore_misses_total", tier="dram") == 1
        assert await s.get("t1/fp0/00/0") is None


async def test_corrupt_ssd_chunk_is_counted_deleted_and_a_miss(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 1 << 20)
    async with make_store([DramTier(1 << 20), ssd]) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(3))
        await r.durable
        await s.dram.delete("c/" + r.key)
        good = bytearray(await ssd.get("c/" + r.key))
        good[-3] ^= 0xFF
        await overwrite(ssd, "c/" + r.key, bytes(good))
        assert await s.get(r.key) is None
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
        assert not await ssd.contains("c/" + r.key)


async def test_corrupt_copy_falls_through_to_a_good_one(tmp_path: Path) -> None:
    ssd, remote = SsdTier(str(tmp_path / "db"), 1 << 20), FlakyTier()
    async with make_store([DramTier(1 << 20), ssd, remote]) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(3))
        await r.durable
        await s.dram.delete("c/" + r.key)
        await overwrite(ssd, "c/" + r.key, b"OVKC garbage")
        c = await s.get(r.key)
        assert c is not None and torch.equal(c.tensor, kv_tensor(3))
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1


async def test_find_chunks_batches_each_tier_and_isolates_a_corrupt_chunk(tmp_path: Path) -> None:
    """One batched read per tier: DRAM hits, SSD hits (promoted), a corrupt SSD copy that
    falls through to the lowest tier, and a miss, each answered in key order."""
    ssd, remote = SsdTier(str(tmp_path / "db"), 1 << 20), FlakyTier()
    async with make_store([DramTier(1 << 20), ssd, remote]) as s:
        rs = [await s.put(meta("s", 0, i), kv_tensor(10 + i)) for i in range(4)]
        for r in rs:
            await r.durable
        for r in rs[1:]:
            await s.dram.delete("c/" + r.key)
        await overwrite(ssd, "c/" + rs[2].key, b"OVKC garbage")
        found = await s.find_chunks([r.key for r in rs] + ["t1/fp0/00/0"])
        assert [tier for _, tier in found] == ["dram", "ssd", remote.name, "ssd", ""]
        for i, (chunk, _) in enumerate(found[:4]):
            assert chunk is not None and torch.equal(chunk.tensor, kv_tensor(10 + i))
        assert found[4][0] is None
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
        assert all([await s.dram.contains("c/" + r.key) for r in rs])  # promoted
        s.check_integrity()


async def test_many_writers_and_readers_verify_checksums(tmp_path: Path) -> None:
    async with make_store([DramTier(64 << 10), SsdTier(str(tmp_path / "db"), 8 << 20)]) as s:
        # DRAM holds only a few chunks, so readers hit SSD (verified) and promotions race.
        async def writer(w: int) -> list[str]:
            keys = []
            for i in range(20):
                r = await s.put(meta(f"w{w}", i, layer=i % 3), kv_tensor(w * 100 + i, tokens=16))
                keys.append(r.key)
                await r.durable
            return keys

        key_lists = await asyncio.gather(*(writer(w) for w in range(6)))

        async def reader(w: int) -> int:
            ok = 0
            for _round in range(2):
                for i, k in enumerate(key_lists[w]):
                    blob = await s.get_blob(k)
                    assert blob is not None
                    c = decode_chunk(blob)  # verifies the CRC
                    assert torch.equal(c.tensor, kv_tensor(w * 100 + i, tokens=16))
                    ok += 1
            return ok

        assert sum(await asyncio.gather(*(reader(w % 6) for w in range(12)))) == 12 * 40
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 0
        assert s.metrics.value("kvstore_evictions_total", tier="dram") > 0
        s.check_integrity()


def test_unsealed_blob_decodes_in_process_only_without_verify() -> None:
    blob = encode_chunk(meta("s", 0, 0), kv_tensor(0), seal=False)
    assert decode_chunk(blob, verify=False).tensor.shape == (2, 4, 2, 8)


async def test_put_blob_refuses_malformed_chunks_whose_checksum_fits() -> None:
    """A blob from a client or a peer is checked as strictly as a read checks it: a chunk
    stored here can never fail a later read for its form (nor poison a session stream)."""
    good = encode_chunk(meta("s", 0, 0), kv_tensor(1))
    trailing = bytearray(good) + bytes(64)  # resealed below: only its length is wrong
    trailing[6:8] = b"\0\0"  # unsealed flag, so seal_chunk computes a fresh checksum
    seal_chunk(trailing)
    async with make_store([DramTier(1 << 20)]) as s:
        for bad in (trailing, forged_chunk(tenant="a/b"), forged_chunk(hashes=[10**8])):
            with pytest.raises(ChunkCorrupt):
                await s.put_blob(bad)
        assert s.stats()[0].entries == 0
        r = await s.put_blob(good)
        assert (await s.get(r.key)) is not None


@pytest.mark.parametrize("then", ["put", "delete"])
async def test_a_read_that_raced_a_put_or_delete_does_not_promote_what_it_found(
    tmp_path: Path, slow_ssd_reads, then: str
) -> None:
    """A get reads v1 from SSD while v2 is put (or the chunk deleted): promoting v1 into
    DRAM would serve it over v2 (or bring the deleted chunk back) until evicted."""
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)]) as s:
        m = meta("s", 0, 0)
        await (await s.put(m, kv_tensor(1))).durable
        await s.delete(m.key, ["dram"])
        s.tiers[1]._nowait = False  # read on a thread: the race window
        reading = asyncio.create_task(s.get(m.key))
        await asyncio.sleep(0.05)
        if then == "put":
            await (await s.put(m, kv_tensor(2))).durable
        else:
            assert await s.delete(m.key) == 1
        assert version((await reading).tensor) == "v1"  # read before the change: fine
        after = await s.get(m.key)
        assert version(after.tensor if after else None) == ("v2" if then == "put" else None)


async def test_a_corrupt_copy_read_while_a_newer_one_lands_takes_only_itself(
    tmp_path: Path, slow_ssd_reads
) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 1 << 20, inline_max_bytes=0)  # chunks in files
    async with make_store([DramTier(1 << 20), ssd]) as s:
        m = meta("s", 0, 0)
        await (await s.put(m, kv_tensor(1))).durable
        await s.delete(m.key, ["dram"])
        rotten = bytearray(await ssd.get("c/" + m.key))
        rotten[-1] ^= 0xFF
        await overwrite(ssd, "c/" + m.key, bytes(rotten))  # the old copy rots on disk
        ssd._nowait = False
        reading = asyncio.create_task(s.get(m.key))
        await asyncio.sleep(0.05)
        await (await s.put(m, kv_tensor(2))).durable  # a good v2 lands on the SSD meanwhile
        assert await reading is None  # the rotten copy: a miss, never wrong data
        await s.delete(m.key, ["dram"])
        assert "ssd" in await s.locate(m.key)  # v2 survived the rotten copy's removal
        assert version((await s.get(m.key)).tensor) == "v2"
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
