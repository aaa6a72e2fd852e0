"""Ranged reads of an S3 object (``tiers/s3_ranges.py``) over a fake endpoint: the bytes
land in order wherever the caller's buffers are, the ranges run in parallel but never more
at once than the executor's workers, and a range that fails fails the read only after
every range of it has ended (nothing writes into the buffers once it has returned)."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.kvstore.tiers.s3_ranges import RangedReads, RangeFailed, S3Stored, content_size
from shared.chunk_codec import ChunkCorrupt

OBJECT = bytes(range(256)) * 40  # 10,240 bytes
RANGE = 1000


class FakeEndpoint:
    """GETs of byte ranges of ``OBJECT``, recording each and how many ran at once."""

    def __init__(self, fail_at: int = -1, short_at: int = -1,
                 gate: threading.Barrier | None = None) -> None:
        self.lock = threading.Lock()
        self.asked: list[tuple[int, int]] = []
        self.running = 0
        self.most = 0
        self.ended = 0
        self.fail_at, self.short_at, self.gate = fail_at, short_at, gate
        self.slow = threading.Event()  # set: the failing range's neighbours may end

    def get_range(self, key: str, lo: int, hi: int) -> bytes:
        assert key == "obj"
        with self.lock:
            self.asked.append((lo, hi))
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if self.gate is not None:
                self.gate.wait()
            if lo == self.fail_at:
                self.slow.set()
                raise ConnectionResetError("peer reset")
            if self.fail_at >= 0:
                assert self.slow.wait(10)
            data = OBJECT[lo:hi]
            return data[:-1] if lo == self.short_at else data
        finally:
            with self.lock:
                self.running -= 1
                self.ended += 1


def stored(ep: FakeEndpoint, workers: int = 4) -> tuple[S3Stored, ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(workers)
    reads = RangedReads(ep.get_range, RANGE, ex, threading.Event())
    return S3Stored(reads, "obj", len(OBJECT), io.BytesIO(OBJECT[:RANGE]), RANGE), ex


def test_the_ranges_land_in_order_across_the_callers_buffers() -> None:
    ep = FakeEndpoint()
    hit, ex = stored(ep)
    with ex:
        # buffers of odd sizes, as a chunk's head and its runs of pool blocks are
        lead, b1, b2 = bytearray(37), bytearray(4000), bytearray(len(OBJECT) - 4037)
        hit.readinto(0, [memoryview(lead), memoryview(b1), memoryview(b2)])
        assert bytes(lead + b1 + b2) == OBJECT
        # the first range came with the reply that told the size: not asked again
        assert sorted(ep.asked) == [(lo, min(lo + RANGE, len(OBJECT)))
                                    for lo in range(RANGE, len(OBJECT), RANGE)]
        assert hit.kept is None  # read straight into place: nothing to promote
        # the stream went straight to the caller: a second read of it goes by range
        assert bytes(hit.read(5, 10)) == OBJECT[5:15] and ep.asked[-1] == (5, 15)
        assert bytes(hit.read(9000, 5000)) == OBJECT[9000:]  # clipped at the end
        assert bytes(hit.blob()) == OBJECT and hit.kept is not None


def test_a_head_read_first_is_kept_and_the_payload_streams_on() -> None:
    # CopyOnRead's general path: the head, then the payload from past it
    ep = FakeEndpoint()
    hit, ex = stored(ep)
    with ex:
        assert bytes(hit.read(0, 100)) == OBJECT[:100]
        assert bytes(hit.read(10, 20)) == OBJECT[10:30]  # (kept: no request)
        payload = bytearray(len(OBJECT) - 300)  # past a 300-byte head: a gap of 200
        hit.readinto(300, [memoryview(payload)])
        assert bytes(payload) == OBJECT[300:]
        assert min(lo for lo, _ in ep.asked) == RANGE  # the first range: the stream alone
        assert bytes(hit.read(150, 100)) == OBJECT[150:250]  # the gap was kept too
        with pytest.raises(ChunkCorrupt):
            hit.readinto(len(OBJECT) - 10, [memoryview(bytearray(60))])


def test_ranges_run_in_parallel_bounded_by_the_executor() -> None:
    # Two ranges must be in flight together for the barrier to open; never more than the
    # two workers, though the read has nine.
    ep = FakeEndpoint(gate=threading.Barrier(2, timeout=30))
    hit, ex = stored(ep, workers=2)
    with ex:
        buf = bytearray(len(OBJECT) - RANGE)
        hit.readinto(RANGE, [memoryview(buf)])
    assert bytes(buf) == OBJECT[RANGE:]
    assert ep.most == 2 and len(ep.asked) == 10  # (10,240 - 1,000 in 1,000s: 10 ranges)


def test_a_failed_range_fails_the_read_after_every_range_ended() -> None:
    ep = FakeEndpoint(fail_at=3 * RANGE)
    hit, ex = stored(ep)
    with ex:
        buf = bytearray(len(OBJECT))
        with pytest.raises(RangeFailed, match="peer reset"):
            hit.readinto(0, [memoryview(buf)])
        # every range had ended when the read raised: none writes into buf later
        assert ep.ended == len(ep.asked) == 10 and ep.running == 0


def test_a_short_range_is_a_failed_read_not_a_corrupt_object() -> None:
    ep = FakeEndpoint(short_at=2 * RANGE)
    hit, ex = stored(ep)
    with ex, pytest.raises(RangeFailed, match="arrived"):
        hit.readinto(0, [memoryview(bytearray(len(OBJECT)))])
    # a first range whose stream ends early: the same, once the other ranges ended
    ep = FakeEndpoint()
    ex = ThreadPoolExecutor(4)
    short = S3Stored(RangedReads(ep.get_range, RANGE, ex, threading.Event()), "obj",
                     len(OBJECT), io.BytesIO(OBJECT[:RANGE - 1]), RANGE)
    with ex, pytest.raises(RangeFailed, match="early"):
        short.readinto(0, [memoryview(bytearray(len(OBJECT)))])
    assert ep.running == 0 and len(ep.asked) == 10


def test_the_size_comes_from_content_range() -> None:
    assert content_size({"ContentRange": "bytes 0-999/10240"}, 1000) == 10240
    assert content_size({}, 512) == 512  # the endpoint sent the whole object
    with pytest.raises(RangeFailed):
        content_size({"ContentRange": "bytes 0-999/*"}, 1000)
