"""Pure logic of the engine-pool path: chunk candidates, pins, bandwidth, lease table."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.kvstore.bandwidth import DEFAULT_BYTES_PER_S, TierBandwidth
from services.kvstore.engine_path.leases import Lease, LeaseTable
from services.kvstore.engine_path.lookup import Candidate, chunk_candidates
from services.kvstore.errors import TierUnavailable
from services.kvstore.tiers import SsdTier
from services.kvstore.tiers.lru_index import PriorityLru
from tests.unit.kvstore.pools import hashes

H = hashes(50)


def test_full_chunk_first_then_known_partial_then_prompt_end() -> None:
    saved = hashes(40)  # the same conversation, saved at 40 blocks
    assert chunk_candidates(H, 0, 16, [saved]) == [Candidate(0, H[0:16], 16)]
    # chunk 2 of the 50-block prompt: full key h47 first, then the saved partial (h39)
    assert chunk_candidates(H, 2, 16, [saved]) == [
        Candidate(32, H[32:48], 48), Candidate(32, saved[32:40], 40),
    ]
    # the prompt's tail chunk (48, 49) is partial: only a chunk ending at h49 can serve it
    assert chunk_candidates(H, 3, 16, [saved]) == [Candidate(48, H[48:50], 50)]


def test_edited_history_candidate_serves_only_the_agreeing_blocks() -> None:
    edited = hashes(40, diverge_at=20)
    saved = hashes(40)
    cands = chunk_candidates(edited, 1, 16, [saved])
    assert cands == [Candidate(16, edited[16:32], 32), Candidate(16, saved[16:32], 20)]
    assert chunk_candidates(edited, 1, 16, []) == [Candidate(16, edited[16:32], 32)]
    assert chunk_candidates(hashes(40, tag="x"), 0, 16, [saved])[1:] == []


def test_priority_lru_pins_skip_eviction_and_expiry() -> None:
    lru = PriorityLru(300)
    for i, k in enumerate("abc"):
        lru.add(k, 100, 0, float(i))
    lru.pin("a")
    lru.pin("a")
    assert lru.victims(100) == ["b"] and lru.older_than(10.0) == ["b", "c"]
    lru.unpin("a")
    assert lru.is_pinned("a")
    lru.unpin("a")
    assert not lru.is_pinned("a") and lru.victims(100) == ["a"]
    lru.check_integrity()


async def test_ssd_full_of_leased_chunks_refuses_a_put_transiently(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 250)
    await ssd.open()
    try:
        await ssd.put("a", b"x" * 100)
        await ssd.put("b", b"x" * 100)
        ssd.pin("a")
        ssd.pin("b")
        with pytest.raises(TierUnavailable, match="leased"):
            await ssd.put("c", b"x" * 100)
        ssd.unpin("b")
        assert await ssd.put("c", b"x" * 100) == ["b"]
        assert await ssd.contains("a")
        ssd.check_integrity()
    finally:
        await ssd.close()


def test_bandwidth_seeds_then_measures() -> None:
    bw = TierBandwidth(["dram", "ssd", "s3"])
    assert bw.snapshot() == {t: DEFAULT_BYTES_PER_S[t] for t in ("dram", "ssd", "s3")}
    bw.observe("ssd", 1 << 20, 0.001)
    assert bw.snapshot()["ssd"] == pytest.approx((1 << 20) / 0.001)
    bw.observe("ssd", 1 << 20, 0.002)
    assert (1 << 20) / 0.002 < bw.snapshot()["ssd"] < (1 << 20) / 0.001
    bw.observe("s3", 10, 1.0)  # too small to measure anything but overhead
    assert "s3" not in bw.measured


async def test_lease_table_release_and_expiry_unpin_once() -> None:
    unpinned: list[str] = []
    table = LeaseTable(0.05, lambda tier, key: unpinned.append(key))
    a = table.grant(Lease("", pins=[(None, "k1")]))  # type: ignore[list-item]
    b = table.grant(Lease("", pins=[(None, "k2")]))  # type: ignore[list-item]
    assert table.release(a) and not table.release(a)
    assert unpinned == ["k1"] and len(table) == 1
    table.check_integrity()
    await asyncio.sleep(0.15)
    assert unpinned == ["k1", "k2"] and table.get(b) is None


def test_mapping_a_pool_populates_committed_pages_and_leaves_holes_alone() -> None:
    import mmap
    import os
    import resource
    import tempfile
    import uuid

    from services.kvstore.engine_path.attach import _populate_committed
    from shared.shm_file import SHM_DIR

    # Where the engine puts CPU pools: /dev/shm, else the temp dir (device.py).
    base = SHM_DIR if SHM_DIR.is_dir() else tempfile.gettempdir()
    path = os.path.join(base, f"overture-test-{uuid.uuid4().hex}")
    size, page = 8 << 20, mmap.PAGESIZE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        for start in (0, 4 << 20):  # the engine committed and used two ranges
            os.pwrite(fd, b"\1" * (1 << 20), start)
        blocks = os.fstat(fd).st_blocks
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        _populate_committed(fd, mm, size)
        assert os.fstat(fd).st_blocks == blocks  # no hole was committed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for off in list(range(0, 1 << 20, page)) + list(range(4 << 20, 5 << 20, page)):
            mm[off] = 1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < (2 << 20) // page // 4  # populated: (almost) no first-touch faults
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
