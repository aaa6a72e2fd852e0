from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.kvstore.config import KVStoreConfig
from services.kvstore.errors import TierOpenError
from services.kvstore.tiers import DramTier, SsdTier, build_tiers
from services.kvstore.tiers.lru_index import PriorityLru
from shared.config import ConfigError, build


def test_lru_evicts_lowest_priority_then_least_recent() -> None:
    idx = PriorityLru(100)
    idx.add("a", 30, priority=1, now=1)
    idx.add("b", 30, priority=0, now=2)
    idx.add("c", 30, priority=0, now=3)
    idx.touch("b", now=4)  # b becomes more recent than c
    assert idx.victims(10) == []
    assert idx.victims(20) == ["c"]
    assert idx.victims(50) == ["c", "b"]
    assert idx.victims(80) == ["c", "b", "a"]
    idx.check_integrity()
    idx.remove("c")
    assert idx.bytes_used == 60
    idx.check_integrity()


async def test_dram_budget_and_eviction_order() -> None:
    t = DramTier(100)
    assert await t.put("l0", b"x" * 40, priority=0) == []
    assert await t.put("l1", b"y" * 40, priority=-1) == []
    # later layer (lower priority) goes first even though l0 is older
    assert await t.put("l0b", b"z" * 40, priority=0) == ["l1"]
    assert await t.get("l1") is None
    assert await t.get("l0") == b"x" * 40
    assert await t.put("l0c", b"w" * 40, priority=0) == ["l0b"]  # LRU within priority
    assert await t.put("huge", b"h" * 101) == ["huge"]
    assert not await t.contains("huge")
    assert t.stats().bytes_used == 80 and t.stats().entries == 2
    t.check_integrity()
    assert await t.delete("l0") and not await t.delete("l0")
    t.check_integrity()


async def test_dram_put_over_a_key_replaces_it_as_the_newest() -> None:
    """A put over a stored key replaces its blob, size and priority, makes it the most
    recent of its priority, forgets its decoded chunk, and evicts others only if the new
    size does not fit."""
    t = DramTier(100)
    await t.put("a", b"a" * 30, priority=0)
    await t.put("b", b"b" * 30, priority=0)
    assert t.get_decoded("a", len) == (b"a" * 30, 30)
    assert await t.put("a", b"A" * 40, priority=0) == []  # in place: now newer than b
    assert t.get_decoded("a", len) == (b"A" * 40, 40)  # decoded again, not the old one
    assert t.stats().bytes_used == 70 and t._index.victims(31) == ["b"]
    assert await t.put("a", b"P" * 20, priority=-1) == []  # another priority bucket
    assert t._index.victims(60) == ["a"]  # the lowest priority goes first
    assert await t.put("a", b"G" * 80, priority=0) == ["b"]  # grows past the budget
    assert await t.get("a") == b"G" * 80 and not await t.contains("b")
    assert t.stats().bytes_used == 80
    t.check_integrity()


async def test_dram_scan_expired() -> None:
    t = DramTier(100)
    await t.put("old", b"1")
    cut = time.time() + 1
    assert await t.scan_expired(cut) == ["old"]
    assert await t.scan_expired(cut - 100) == []


@pytest.mark.parametrize("inline_max", [4096, 0], ids=["in-rocksdb", "in-files"])
async def test_ssd_roundtrip_capacity_and_reopen(tmp_path: Path, inline_max: int) -> None:
    path = str(tmp_path / "db")
    files = tmp_path / "db" / "blobs"
    t = SsdTier(path, capacity_bytes=1000, inline_max_bytes=inline_max)
    await t.open()
    try:
        assert await t.put("a", b"A" * 400, priority=0) == []
        assert await t.put("b", b"B" * 400, priority=-3) == []
        assert await t.put("c", b"C" * 400, priority=0) == ["b"]
        assert await t.get("b") is None
        assert await t.get("a") == b"A" * 400
        assert await t.put("a", b"a" * 500, priority=0) == []  # replace frees the old size
        assert t.stats().bytes_used == 900
        t.check_integrity()
        assert await t.delete("c")
        # evicted, replaced and deleted blobs leave no file behind
        assert len(list(files.iterdir())) == (1 if inline_max == 0 else 0)
    finally:
        await t.close()
    (files / "00000000000000ff").write_bytes(b"a crash between file and catalog")
    t2 = SsdTier(path, capacity_bytes=1000, inline_max_bytes=inline_max)
    await t2.open()
    try:
        assert await t2.get("a") == b"a" * 500
        assert not await t2.contains("c")
        assert t2.stats().entries == 1 and t2.stats().bytes_used == 500
        assert len(list(files.iterdir())) == (1 if inline_max == 0 else 0)  # orphan removed
        await t2.put("d", b"D" * 300)  # file numbers continue past the surviving ones
        assert await t2.get("d") == b"D" * 300 and await t2.get("a") == b"a" * 500
        t2.check_integrity()
    finally:
        await t2.close()


async def test_ssd_locked_path_is_a_clear_open_error(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from rocksdict import Rdict, Options; o=Options(raw_mode=True); "
            "o.create_if_missing(True); d=Rdict(sys.argv[1], o); print('open', flush=True); "
            "time.sleep(60)",
            path,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        t = SsdTier(path, 1000)
        with pytest.raises(TierOpenError, match="kvstore.ssd_path"):
            await t.open()
        await t.close()
    finally:
        holder.kill()
        holder.wait()


async def test_ssd_path_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(TierOpenError, match="kvstore.ssd_path"):
        await SsdTier(str(f / "db"), 1000).open()


def test_registry_builds_enabled_tiers_and_rejects_unknown(tmp_path: Path) -> None:
    cfg = build(KVStoreConfig, {"ssd_path": str(tmp_path / "db")})
    assert [t.name for t in build_tiers(cfg)] == ["dram", "ssd"]
    cfg = build(KVStoreConfig, {"s3": {"bucket": "kv-bucket"}})
    assert [t.name for t in build_tiers(cfg)] == ["dram", "s3"]
    with pytest.raises(ConfigError, match="unknown tier 'nvme'.*known tiers: dram, s3, ssd"):
        build_tiers(build(KVStoreConfig, {"tiers": ["dram", "nvme"]}))
    with pytest.raises(ConfigError, match="first tier must be 'dram'"):
        build_tiers(build(KVStoreConfig, {"tiers": ["ssd"], "ssd_path": str(tmp_path / "x")}))


class _FullDisk:
    """Stands in for a RocksDB handle whose writes fail as on a full disk."""

    def __init__(self, real: object) -> None:
        self.real = real

    def write(self, batch: object) -> None:
        raise Exception("IO error: No space left on device")

    def close(self) -> None:
        self.real.close()  # type: ignore[attr-defined]


async def test_ssd_disk_full_is_reported_in_health_not_a_crash(tmp_path: Path) -> None:
    from services.kvstore.errors import TierUnavailable

    t = SsdTier(str(tmp_path / "db"), capacity_bytes=1000)
    await t.open()
    try:
        await t.put("a", b"A" * 10)
        t._db = _FullDisk(t._db)  # type: ignore[assignment]
        with pytest.raises(TierUnavailable, match="No space left"):
            await t.put("b", b"B" * 10)
        s = t.stats()
        assert not s.healthy and "No space left" in s.detail
        assert not await t.contains("b") and await t.contains("a")
        t.check_integrity()
    finally:
        await t.close()
