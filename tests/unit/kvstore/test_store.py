from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from services.kvstore.errors import ManifestIncomplete, TierUnavailable, WriteDropped
from services.kvstore.manifests import ManifestStore
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store import TieredStore
from services.kvstore.streaming import stream_session
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import ChunkCorrupt, decode_chunk, encode_chunk, seal_chunk
from tests.unit.kvstore.chunks import (
    TENANT,
    forged_chunk,
    kv_tensor,
    meta,
    session_chunks,
    session_manifest,
)
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.tier_faults import lose, overwrite


def make_store(tiers: list, **kw) -> TieredStore:
    kw.setdefault("retry_backoff_max_s", 0.02)
    kw.setdefault("drain_s", 0.5)
    return TieredStore(tiers, KVStoreMetrics(), **kw)


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


async def test_ssd_get_many_answers_in_order_with_misses(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 1 << 20)
    await ssd.open()
    try:
        await ssd.put("a", b"1")
        await ssd.put("c", b"3")
        assert await ssd.get_many(["c", "b", "a", "c"]) == [b"3", None, b"1", b"3"]
        assert await ssd.get_many([]) == []
    finally:
        await ssd.close()


@pytest.mark.parametrize("nowait", [True, False])
async def test_ssd_get_many_checked_runs_the_check_where_it_reads(
    tmp_path: Path, nowait: bool
) -> None:
    """Hits come back with the check's result (or the ChunkCorrupt it raised), misses as
    None, in key order. A chunk file the page cache holds is checked inline on the loop
    (RWF_NOWAIT); otherwise on the tier's reading thread. Chunks reach the check unread
    (``FileStored``), small values (inline in RocksDB) as blobs, read on the thread."""
    from services.kvstore.tiers.ssd import FileStored

    ssd = SsdTier(str(tmp_path / "db"), 1 << 22, inline_max_bytes=512)
    await ssd.open()
    try:
        ssd._nowait = nowait and ssd._nowait
        good = bytes(encode_chunk(meta("s", 0, 0), kv_tensor(5)))
        assert len(good) > ssd.inline_max_bytes
        bad = bytearray(good)
        bad[-1] ^= 0xFF
        small = bytes(encode_chunk(meta("s", 1, 0), kv_tensor(5)[:, :1]))
        assert len(small) <= ssd.inline_max_bytes
        for k, v in (("good", good), ("bad", bytes(bad)), ("small", small)):
            await ssd.put(k, v)
        seen: dict[str, tuple[type, int]] = {}

        def check(hit):
            chunk = decode_chunk(hit.blob())
            seen[chunk.meta.key] = (type(hit), threading.get_ident())
            return chunk

        got = await ssd.get_many_checked(["bad", "none", "good", "small"], check)
        assert got[1] is None
        assert got[0] is not None and isinstance(got[0][1], ChunkCorrupt)
        assert got[2] is not None and got[2][0].kept == good
        assert torch.equal(got[2][1].tensor, kv_tensor(5))
        assert got[3] is not None and torch.equal(got[3][1].tensor, kv_tensor(5)[:, :1])
        kind, thread = seen[meta("s", 0, 0).key]
        assert kind is FileStored
        assert (thread == threading.get_ident()) == ssd._nowait
        kind, thread = seen[meta("s", 1, 0).key]
        assert kind is not FileStored and thread != threading.get_ident()
        ssd.check_integrity()
    finally:
        await ssd.close()


async def test_ssd_reads_racing_replaces_see_a_whole_version_never_corruption(
    tmp_path: Path,
) -> None:
    """Readers of chunk files being replaced (new file, catalog, unlink of the old one)
    get one complete version or a miss, never a corrupt read, and nothing is deleted."""
    ssd = SsdTier(str(tmp_path / "db"), 1 << 24)
    await ssd.open()
    try:
        versions = [bytes(encode_chunk(meta("s", 0, 0), kv_tensor(v, tokens=64)))
                    for v in range(4)]
        keys = [f"k{i}" for i in range(4)]
        for k in keys:
            await ssd.put(k, versions[0])
        stop = asyncio.Event()

        async def replacer() -> None:
            for round_ in range(1, 30):
                for k in keys:
                    await ssd.put(k, versions[round_ % 4])
            stop.set()

        def check(hit):
            return decode_chunk(hit.blob())  # verifies the checksum

        async def reader() -> int:
            n = 0
            while not stop.is_set():
                for hit in await ssd.get_many_checked(keys, check):
                    assert hit is not None, "a replaced key went missing"
                    assert not isinstance(hit[1], ChunkCorrupt), hit[1]
                    assert bytes(hit[0].blob()) in versions
                    n += 1
                await asyncio.sleep(0)
            return n

        counts = await asyncio.gather(replacer(), *(reader() for _ in range(3)))
        assert sum(c for c in counts if c) > 0
        assert len(list((tmp_path / "db" / "blobs").iterdir())) == len(keys)
        ssd.check_integrity()
    finally:
        await ssd.close()


async def test_ssd_without_rwf_nowait_reads_on_its_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses RWF_NOWAIT turns inline reads off for good; reads still
    succeed, on the tier's threads."""
    import errno
    import os

    ssd = SsdTier(str(tmp_path / "db"), 1 << 22)
    await ssd.open()
    try:
        blob = bytes(encode_chunk(meta("s", 0, 0), kv_tensor(3, tokens=64)))
        await ssd.put("a", blob)
        real = os.preadv
        where: list[str] = []

        def no_nowait(fd, bufs, offset, flags=0):
            where.append(threading.current_thread().name)
            if flags:
                raise OSError(errno.EOPNOTSUPP, "not supported")
            return real(fd, bufs, offset, flags)

        monkeypatch.setattr(os, "preadv", no_nowait)
        assert await ssd.get("a") == blob
        assert await ssd.get("a") == blob
        assert not ssd._nowait
        # one refused inline try, then every read on a kv-ssd thread
        assert where[0] == threading.current_thread().name
        assert all(t.startswith("kv-ssd") for t in where[1:]) and len(where) == 3
    finally:
        await ssd.close()


async def test_ssd_file_lost_under_its_entry_is_corrupt_and_dropped(tmp_path: Path) -> None:
    """A chunk whose file vanished (the disk lost it) reads as corrupt in a checked read
    (the store counts and deletes it) and as a miss, dropped, in a plain one."""
    ssd = SsdTier(str(tmp_path / "db"), 1 << 22, inline_max_bytes=256)
    await ssd.open()
    try:
        blob = bytes(encode_chunk(meta("s", 0, 0), kv_tensor(5)))
        await ssd.put("a", blob)
        await ssd.put("b", blob)
        await lose(ssd, "a")
        await lose(ssd, "b")
        (hit,) = await ssd.get_many_checked(["a"], lambda h: decode_chunk(h.blob()))
        assert hit is not None and isinstance(hit[1], ChunkCorrupt)
        assert await ssd.get("b") is None and not await ssd.contains("b")
        ssd.check_integrity()
    finally:
        await ssd.close()


async def test_remote_down_queues_retries_and_falls_back_to_local(tmp_path: Path) -> None:
    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote]) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(1))
        await asyncio.sleep(0.05)
        assert not r.durable.done()
        assert s.health()[0] is False and "remote degraded" in s.health()[1]
        await s.dram.delete("c/" + r.key)
        assert (await s.get(r.key)) is not None  # SSD serves while the remote is down
        remote.down = False
        await asyncio.wait_for(r.durable, 5)
        assert s.health() == (True, "ok")


async def test_full_queue_drops_lowest_priority_oldest_and_keeps_local_copies() -> None:
    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), remote], write_queue=3, write_workers=1) as s:
        receipts = [await s.put(meta("s", i, layer=0), kv_tensor(i), priority=p)
                    for i, p in enumerate([5, 1, 5, 1, 5])]
        await asyncio.sleep(0.05)
        dropped = [i for i, r in enumerate(receipts) if r.durable.done() and isinstance(r.durable.exception(), WriteDropped)]
        assert dropped == [1, 3]
        assert s.writer.dropped == 2 and s.metrics.value("kvstore_write_behind_dropped_total") == 2
        for r in receipts:  # every chunk still readable locally
            assert await s.get(r.key) is not None
        remote.down = False
        for i in (0, 2, 4):
            await asyncio.wait_for(receipts[i].durable, 5)
        s.check_integrity()


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
        assert [torch.equal(c.tensor, t) for c, (_cm, t) in zip(layer1, chunks[3:])] == [True] * 3


async def test_stream_session_is_lowest_layer_first_with_misses() -> None:
    async with make_store([DramTier(1 << 20)]) as s:
        m = session_manifest("sess", num_blocks=4, num_layers=3, bpc=2)
        chunks = session_chunks(m)
        for cm, t in chunks:
            await s.put(cm, t)
        await s.delete(chunks[3][0].key)  # layer 1, chunk 1
        seen = [(layer, i, blob is not None) async for layer, i, _k, blob in stream_session(s, m, window=2)]
        assert seen == [(0, 0, True), (0, 1, True), (1, 0, True), (1, 1, False), (2, 0, True), (2, 1, True)]
        first = [x async for x in stream_session(s, m, first_layer=2)]
        assert [(x[0], x[1]) for x in first] == [(2, 0), (2, 1)]
        decode_chunk(first[0][3])  # blobs handed out are sealed and verify


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


async def test_manifest_refused_after_a_named_chunk_was_deleted() -> None:
    async with make_store([DramTier(1 << 20), FlakyTier()]) as s:
        m = session_manifest("gone", num_blocks=2, num_layers=2, bpc=2)
        for cm, t in session_chunks(m):
            await (await s.put(cm, t)).durable
        await s.delete(m.chunk_keys()[1])
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(m)
        s.check_integrity()


async def test_ssd_put_cancelled_mid_write_leaves_index_and_disk_agreeing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose caller is cancelled while its thread writes (the write-behind giving
    up at close, a client gone) still finishes and is accounted before the lock is free:
    the new value is readable, the replaced file gone, and a second put is not interleaved."""
    ssd = SsdTier(str(tmp_path / "db"), 1 << 22, inline_max_bytes=0)
    await ssd.open()
    try:
        old, new = (bytes(encode_chunk(meta("s", 0, 0), kv_tensor(v, tokens=64))) for v in (1, 2))
        await ssd.put("a", old)
        started, release = threading.Event(), threading.Event()
        real = ssd._write_blocking

        def slow(*args):
            started.set()
            release.wait(10)
            return real(*args)

        monkeypatch.setattr(ssd, "_write_blocking", slow)
        task = asyncio.create_task(ssd.put("a", new))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # it waits for the thread it cannot stop
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.setattr(ssd, "_write_blocking", real)
        assert await ssd.get("a") == new
        assert len(list((tmp_path / "db" / "blobs").iterdir())) == 1
        ssd.check_integrity()
    finally:
        await ssd.close()


async def test_ssd_short_reads_are_read_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking preadv may return less than asked: the rest is read, not called corrupt."""
    import os

    ssd = SsdTier(str(tmp_path / "db"), 1 << 22, inline_max_bytes=0)
    await ssd.open()
    try:
        blob = bytes(encode_chunk(meta("s", 0, 0), kv_tensor(4, tokens=64)))
        await ssd.put("a", blob)
        ssd._nowait = False
        real = os.preadv

        def dribble(fd, bufs, offset, flags=0):  # at most 1000 bytes per call
            return real(fd, [memoryview(bufs[0])[:1000]], offset, flags)

        monkeypatch.setattr(os, "preadv", dribble)
        assert await ssd.get("a") == blob
        assert ssd.keys() == ["a"]
    finally:
        await ssd.close()


async def test_ssd_file_handle_is_dead_once_the_read_is_over(tmp_path: Path) -> None:
    """A FileStored kept past its read cannot read through a descriptor number that may
    belong to another file by then."""
    ssd = SsdTier(str(tmp_path / "db"), 1 << 22, inline_max_bytes=0)
    await ssd.open()
    try:
        await ssd.put("a", bytes(encode_chunk(meta("s", 0, 0), kv_tensor(5, tokens=64))))
        kept = []
        await ssd.get_many_checked(["a"], lambda hit: kept.append(hit) or 0)
        with pytest.raises(RuntimeError):
            kept[0].read(0, 16)
    finally:
        await ssd.close()


async def test_ssd_unreadable_catalog_entry_is_dropped_at_open(tmp_path: Path) -> None:
    """A damaged catalog entry costs its chunk (a miss), not the tier: the rest opens."""
    from rocksdict import Options, Rdict

    path = str(tmp_path / "db")
    ssd = SsdTier(path, 1 << 22, inline_max_bytes=0)
    await ssd.open()
    blobs = {k: bytes(encode_chunk(meta(k, 0, 0), kv_tensor(i, tokens=64)))
             for i, k in enumerate(("a", "b"))}
    for k, b in blobs.items():
        await ssd.put(k, b)
    await ssd.close()
    db = Rdict(path, Options(raw_mode=True))
    db[b"m:a"] = b"\xc1 not msgpack"
    db.close()
    ssd = SsdTier(path, 1 << 22, inline_max_bytes=0)
    await ssd.open()
    try:
        assert ssd.keys() == ["b"]
        assert await ssd.get("b") == blobs["b"]
        assert await ssd.get("a") is None
        assert len(list((tmp_path / "db" / "blobs").iterdir())) == 1  # a's file: an orphan
        ssd.check_integrity()
    finally:
        await ssd.close()


class GatedTier(FlakyTier):
    """A remote whose puts store the blob, then wait for ``gate`` before answering: the
    window where the object exists but its write has not been acknowledged yet."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.stored = asyncio.Event()

    async def put(self, key: str, blob, priority: int = 0) -> list[str]:
        out = await super().put(key, blob, priority)
        self.stored.set()
        await self.gate.wait()
        return out


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


async def test_closing_with_s3_black_holed_neither_stalls_the_loop_nor_overruns() -> None:
    """An S3 endpoint that accepts connections and never answers: close gives up on the
    write-behind after drain_s, stops the S3 retries, and never blocks the event loop."""
    import socket

    from services.kvstore.config import S3Config
    from services.kvstore.tiers.s3 import S3Tier

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    held: list = []
    stop = threading.Event()

    def accept() -> None:
        hole.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(hole.accept())
            except OSError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        s3 = S3Tier(S3Config(endpoint_url=f"http://127.0.0.1:{hole.getsockname()[1]}",
                             bucket="kv", access_key_id="x", secret_access_key="x",
                             timeout_s=0.5, max_attempts=2, backoff_s=0.2))
        store = make_store([DramTier(1 << 24), s3], drain_s=0.5)
        await store.__aenter__()
        gaps: list[float] = []

        async def heartbeat() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await store.put(meta("s", 0, 0), kv_tensor(1))
        await asyncio.sleep(0.3)  # the S3 put is now on an S3 thread, waiting
        gaps.clear()
        t0 = time.monotonic()
        await store.__aexit__(None, None, None)
        took = time.monotonic() - t0
        await asyncio.sleep(0.05)
        beat.cancel()
        assert max(gaps) < 0.5, f"event loop stalled {max(gaps):.2f}s"
        assert took < 0.5 + 0.5 + 1.5, f"close took {took:.2f}s"  # drain, one call, slack
    finally:
        stop.set()
        acceptor.join(2)
        for conn, _ in held:
            conn.close()
        hole.close()


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


class GatedRemote(FlakyTier):
    """A lowest tier whose chunk puts store the object, then wait for ``gate``; deletes
    wait for ``delete_gate`` before they act."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.stored = asyncio.Event(), asyncio.Event()
        self.delete_gate = asyncio.Event()
        self.delete_gate.set()
        self.deleting = asyncio.Event()

    async def put(self, key: str, blob, priority: int = 0) -> list[str]:
        out = await super().put(key, blob, priority)
        if key.startswith("c/"):
            self.stored.set()
            await self.gate.wait()
        return out

    async def delete(self, key: str) -> bool:
        self.deleting.set()
        await self.delete_gate.wait()
        return await super().delete(key)


async def test_a_chunk_deleted_while_its_write_is_in_flight_blocks_its_manifest() -> None:
    """The write completes after the delete: its ack must not let a manifest name it."""
    remote = GatedRemote()
    async with make_store([DramTier(1 << 20), remote]) as s:
        m = session_manifest("s", 1, 1, 1)
        (cm, t), = session_chunks(m)
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


async def test_chunks_held_locally_but_never_written_down_are_rewritten_for_a_manifest(
    tmp_path: Path,
) -> None:
    """A restart forgets which chunks were still to be written to the lowest tier: the
    SSD has them, so saves skip them. The manifest writes them down from the SSD copy."""
    remote = FlakyTier()
    remote.down = True
    m = session_manifest("s", 4, 2, 1)
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote],
                          drain_s=0.2) as s:
        for cm, t in session_chunks(m):
            await s.put(cm, t)
        await asyncio.sleep(0.3)  # on SSD; the lowest tier refuses every write
    remote.down = False
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20),
                           remote]) as s:
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
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote],
                          write_queue=2) as s:
        remote.down = True
        for cm, t in session_chunks(m):
            await s.put(cm, t)
        depth = s.writer.depth
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(s).put_manifest(m, wait_s=0.1)
        assert s.writer.depth <= depth  # nothing queued again to churn against an outage
        remote.down = False


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
    (cm, t), = session_chunks(m)
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


async def wait_durable_from_scratch(s: TieredStore, m) -> None:
    s.ledger._durable.clear()  # as after a restart
    await ManifestStore(s).wait_durable(m, wait_s=1)


async def test_lowest_tier_retries_are_served_under_a_steady_load_of_new_writes() -> None:
    """A short outage leaves chunks waiting for their lowest-tier retry. The tier is back,
    but new saves keep arriving faster than the writer drains: the retries must still get
    their turn instead of waiting until they are the first dropped."""

    class SlowLocal(DramTier):
        name = "ssd"

        async def put(self, key: str, blob, priority: int = 0) -> list[str]:
            await asyncio.sleep(0.005)
            return await super().put(key, blob, priority)

    remote = FlakyTier()
    async with make_store([DramTier(1 << 28), SlowLocal(1 << 28), remote], write_queue=64,
                          write_workers=1) as s:
        remote.down = True
        early = [await s.put(meta("a", i, 0), kv_tensor(i)) for i in range(5)]
        await asyncio.sleep(0.1)  # on the SSD; their lowest-tier write waits for a retry
        remote.down = False
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 1.5:  # about 1.5x what one worker drains
            for _ in range(3):
                await s.put(meta("b", n, 0), kv_tensor(n))
                n += 1
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*(r.durable for r in early)), 5)


@pytest.fixture
def slow_ssd_reads(monkeypatch: pytest.MonkeyPatch):
    """SSD reads on threads that take 0.2 s once the file is open (the old version)."""
    from services.kvstore.tiers import ssd as ssd_mod

    real = ssd_mod.apply_check

    def slow(*a):
        time.sleep(0.2)
        return real(*a)

    monkeypatch.setattr(ssd_mod, "apply_check", slow)


def version(t: torch.Tensor | None) -> str | None:
    return next((f"v{i}" for i in (1, 2) if t is not None and torch.equal(t, kv_tensor(i))),
                None if t is None else "other")


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


async def test_writes_of_one_key_land_in_the_order_they_were_made(tmp_path: Path) -> None:
    """v1's lowest-tier write fails and waits for a retry; v2 is put meanwhile. v1 must
    not land last: every tier ends with v2."""
    from shared.chunk_codec import decode_chunk

    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20),
                           remote]) as s:
        m = meta("s", 0, 0)
        r1 = await s.put(m, kv_tensor(1))
        await asyncio.sleep(0.03)  # v1 failed on the remote, retrying
        r2 = await s.put(m, kv_tensor(2))
        remote.down = False
        await asyncio.gather(r1.durable, r2.durable, return_exceptions=True)
        await s.writer.wait_idle(5)
        tk = "c/" + m.key
        assert version(decode_chunk(await remote.get(tk)).tensor) == "v2"
        assert version(decode_chunk(await s.tiers[1].get(tk)).tensor) == "v2"
        assert version((await s.get(m.key)).tensor) == "v2"
        s.writer.check_integrity()


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
