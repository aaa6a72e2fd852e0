"""Scheduler over a real (tiny) block pool: budget, chunking, decode priority, preemption,
FCFS, prefix hits. Two layers, block_size 4, 4 blocks per page."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.engine.api_types import SamplingParams
from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.block_tables import BlockTables
from services.engine.kvcache.device_memory import DeviceMemory
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import Sequence

from .conftest import BLOCK_SIZE, make_pool

LAYERS = 2


class Harness:
    def __init__(self, pool: DeviceMemory, max_num_seqs: int = 8, budget: int = 16) -> None:
        self.blocks = BlockAllocator(pool)
        self.kv = BlockTables(self.blocks, LAYERS, BLOCK_SIZE)
        self.sched = Scheduler(self.kv, max_num_seqs, budget)
        self.n = 0

    def add(self, prompt_len: int, first_token: int | None = None, priority: int = 0
            ) -> Sequence:
        """A sequence whose prompt differs from every other's unless ``first_token`` given."""
        first = 1 + 100 * self.n if first_token is None else first_token
        seq = Sequence(
            f"r{self.n}",
            list(range(first, first + prompt_len)),
            SamplingParams(),
            b"seed" * 4,
            1000,
            self.n,
            LAYERS,
            priority=priority,
        )
        self.n += 1
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        """Schedule, 'compute', append a token to every sequence that is due one."""
        out = self.sched.schedule()
        for seq in self.sched.advance(out):
            seq.token_ids.append(99)
        self.check()
        return out

    def check(self) -> None:
        self.blocks.check_integrity()
        held = {}
        for seq in [*self.sched.running, *self.sched.waiting]:
            seq.check()
            for t in seq.block_tables:
                for b in t:
                    held[b] = held.get(b, 0) + 1
        assert all(self.blocks.refcount[b] == n for b, n in held.items())
        assert self.blocks.num_used == len(held)


@pytest.fixture
def pool() -> Iterator[DeviceMemory]:
    p = make_pool(num_pages=8)  # 32 blocks = 16 per layer
    yield p
    p.close()


def test_budget_and_chunked_prefill(pool: DeviceMemory) -> None:
    h = Harness(pool, budget=16)
    a, b, c = h.add(10), h.add(10), h.add(10)
    out = h.step()
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 6}  # r1 chunked, r2 waits
    assert a.num_output_tokens == 1 and b.num_computed_tokens == 6
    assert b.block_tables[0] == [6, 7] and b.block_tables[1] == [8, 9]
    out = h.step()
    # decodes first (r0), then r1's remaining prefill, then r2's first chunk
    assert list(out.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 4), ("r2", 10)]
    assert c.num_output_tokens == 1


def test_decodes_come_before_prefills_when_the_budget_is_short(pool: DeviceMemory) -> None:
    h = Harness(pool, budget=8)
    h.add(3), h.add(3)
    h.step()  # both prefill (6 tokens)
    h.add(20)
    out = h.step()
    assert list(out.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 1), ("r2", 6)]


def test_max_num_seqs(pool: DeviceMemory) -> None:
    h = Harness(pool, max_num_seqs=2, budget=64)
    for _ in range(3):
        h.add(2)
    out = h.step()
    assert list(out.num_scheduled_tokens) == ["r0", "r1"] and len(h.sched.waiting) == 1


def test_preempts_the_youngest_and_requeues_it_first() -> None:
    small = make_pool(num_pages=2)  # 8 blocks = 4 per layer = 16 tokens per sequence total
    try:
        h = Harness(small, budget=64)
        old, young = h.add(7), h.add(7)
        h.step()  # 2 blocks per layer each: pool full
        assert h.blocks.num_available() == 0
        assert h.step().preempted == []  # position 7 still fits in block 2
        out = h.step()  # both need a 3rd block at position 8: young is preempted for old
        assert out.preempted == ["r1"] and list(out.num_scheduled_tokens) == ["r0"]
        assert young.num_computed_tokens == 0 and young.num_blocks == 0
        assert list(h.sched.waiting) == [young] and young.num_output_tokens == 2
        while old in h.sched.running and old.num_tokens < 12:
            h.step()
        h.sched.finish(old)
        h.check()
        out = h.step()  # young resumes: recomputes prompt + its 2 output tokens
        # (its layer-1 blocks were evicted first for old, so nothing is reusable)
        assert out.num_scheduled_tokens == {"r1": 9}
        assert young.num_cached_tokens == 0
    finally:
        small.close()


def test_fcfs_head_of_line_is_not_overtaken() -> None:
    small = make_pool(num_pages=2)  # 4 blocks per layer
    try:
        h = Harness(small, budget=64)
        first = h.add(12)  # 3 blocks per layer
        h.step()
        big, tiny = h.add(8), h.add(1)  # big needs 2 blocks per layer: only 1 left
        out = h.step()
        assert "r1" not in out.num_scheduled_tokens and "r2" not in out.num_scheduled_tokens
        assert list(h.sched.waiting) == [big, tiny]
        h.sched.finish(first)
        out = h.step()
        assert list(out.num_scheduled_tokens) == ["r1", "r2"]
    finally:
        small.close()


def test_prefix_hit_reuses_blocks_of_every_layer(pool: DeviceMemory) -> None:
    h = Harness(pool, budget=64)
    a = h.add(10, first_token=1)
    h.step()
    a_tables = [list(t) for t in a.block_tables]
    h.sched.finish(a)
    h.check()
    b = h.add(10, first_token=1)  # same prompt
    out = h.step()
    # 2 full blocks cached in both layers; the partial last block is recomputed
    assert out.num_scheduled_tokens == {"r1": 2}
    assert b.num_cached_tokens == 8
    assert [t[:2] for t in b.block_tables] == [t[:2] for t in a_tables]


def test_prefix_hit_stops_where_a_layer_is_missing(pool: DeviceMemory) -> None:
    h = Harness(pool, budget=64)
    a = h.add(10)
    h.step()
    layer1_block1 = a.block_tables[1][1]
    h.sched.finish(a)
    key = h.blocks.key[layer1_block1]
    h.blocks.touch([layer1_block1])  # take it out of the cache as eviction would
    h.blocks.free([layer1_block1])
    h.blocks.check_integrity()
    assert h.blocks.cached_block(key) == layer1_block1
    h.blocks.evict(h.blocks.num_evictable)  # drop everything: nothing to hit
    b = h.add(10)
    out = h.step()
    assert out.num_scheduled_tokens == {"r1": 10} and b.num_cached_tokens == 0


def test_abort_while_waiting_and_running(pool: DeviceMemory) -> None:
    h = Harness(pool, max_num_seqs=1, budget=64)
    run, wait = h.add(5), h.add(5)
    h.step()
    h.sched.finish(wait)
    h.sched.finish(run)
    h.check()
    assert not h.sched.has_work() and h.blocks.num_used == 0


def test_a_higher_priority_request_is_admitted_before_earlier_ones(pool: DeviceMemory) -> None:
    h = Harness(pool, max_num_seqs=1, budget=64)
    first = h.add(2)
    h.step()  # the one seat is taken
    low1, low2, high, mid = h.add(2), h.add(2), h.add(2, priority=5), h.add(2, priority=1)
    assert list(h.sched.waiting) == [high, mid, low1, low2]  # FCFS within a priority
    h.sched.finish(first)
    assert list(h.step().num_scheduled_tokens) == [high.request_id]



def test_a_stream_of_higher_priorities_cannot_starve_a_request(pool: DeviceMemory) -> None:
    from services.engine.scheduler import MAX_OVERTAKES

    h = Harness(pool, max_num_seqs=1, budget=64)
    h.add(2)
    h.step()
    low = h.add(2)
    for _ in range(MAX_OVERTAKES):
        h.add(2, priority=9)
    assert h.sched.waiting[-1] is low and low.overtaken == MAX_OVERTAKES
    late = h.add(2, priority=9)
    assert h.sched.waiting[-1] is late  # it may be passed no more
