"""The SSD tier: catalog and blob files, inline and threaded reads, crash and loss handling."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from services.kvstore.tiers import SsdTier
from services.kvstore.tiers import ssd as ssd_module
from shared.chunk_codec import ChunkCorrupt, decode_chunk, encode_chunk
from tests.unit.kvstore.chunks import (
    kv_tensor,
    meta,
)
from tests.unit.kvstore.tier_faults import lose


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
        real = ssd_module.write_blocking

        def slow(*args):
            started.set()
            release.wait(10)
            return real(*args)

        monkeypatch.setattr(ssd_module, "write_blocking", slow)
        task = asyncio.create_task(ssd.put("a", new))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # it waits for the thread it cannot stop
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.setattr(ssd_module, "write_blocking", real)
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


async def test_ssd_keeps_tenants_kv_readable_by_its_owner_only(tmp_path: Path) -> None:
    import os
    import stat

    (tmp_path / "db").mkdir(mode=0o755)  # (an existing folder is tightened too)
    ssd = SsdTier(str(tmp_path / "db"), 1 << 22, inline_max_bytes=256)
    await ssd.open()
    try:
        await ssd.put("a", bytes(encode_chunk(meta("s", 0, 0), kv_tensor(5))))
        dirs = [tmp_path / "db", *(p for p in (tmp_path / "db").rglob("*") if p.is_dir())]
        files = [p for p in (tmp_path / "db").rglob("*") if p.is_file()]
        blob_files = [p for p in files if p.parent != tmp_path / "db"]
        assert blob_files, files  # (a chunk above inline_max_bytes: its own file)
        for d in dirs[:1] + [p.parent for p in blob_files]:
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        for f in blob_files:
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    finally:
        await ssd.close()
