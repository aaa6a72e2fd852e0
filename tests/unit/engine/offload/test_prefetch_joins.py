"""A request joins a device prefetch of its prefix by awaiting an event, not by polling:
the worker thread posts a load's start and its settlement to the event loop
(call_soon_threadsafe), the loop's book sets the event once every load of that prefix is
settled, and by then the loaded blocks are indexed. Synchronisation here is by events and
thread hand-offs only (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from services.engine.api_types import SamplingParams
from services.engine.config import EngineConfig, OffloadConfig
from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.block_tables import BlockTables
from services.engine.kvcache.device_memory import DeviceMemory
from services.engine.offload import DevicePrefetch, PrefetchJoins, PrefetchOrder, ReusePlanner
from services.engine.reuse_plan import ReusePlan
from services.engine.validation import PreparedRequest
from shared.hashing import block_hashes
from shared.kv_layout import KVSpan, StoredPrefix
from shared.session_key import SessionKey

from ..conftest import BLOCK_SIZE, make_pool
from .test_device_prefetch import LAYERS, NoRequests, Transport

H = b"h0".ljust(16, b".")


class Joins(PrefetchJoins):
    """Tells the test when a request starts waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.waiting = asyncio.Event()

    async def join(self, first_hash: bytes, timeout_s: float) -> bool:
        self.waiting.set()
        return await super().join(first_hash, timeout_s)


async def posted(fn, *args) -> None:
    """Call ``fn`` on another thread, as the worker does; its posts to the loop have run
    when this returns (they were queued before the thread's own completion)."""
    await asyncio.to_thread(fn, *args)


async def test_a_join_with_no_load_under_way_returns_at_once() -> None:
    joins = PrefetchJoins(asyncio.get_running_loop())
    assert not joins.loading(H)
    assert await joins.join(H, timeout_s=30.0) is False


async def test_a_join_waits_until_the_load_is_settled() -> None:
    joins = Joins(asyncio.get_running_loop())
    await posted(joins.started, H)
    assert joins.loading(H)
    waiter = asyncio.create_task(joins.join(H, timeout_s=30.0))
    await joins.waiting.wait()
    assert not waiter.done()
    await posted(joins.settled, H)
    assert await asyncio.wait_for(waiter, 10) is True
    assert not joins.loading(H)


async def test_two_loads_of_one_prefix_are_both_waited_for() -> None:
    joins = Joins(asyncio.get_running_loop())
    await posted(joins.started, H)
    await posted(joins.started, H)  # another session with the same first block
    waiter = asyncio.create_task(joins.join(H, timeout_s=30.0))
    await joins.waiting.wait()
    await posted(joins.settled, H)
    assert not waiter.done() and joins.loading(H)
    await posted(joins.settled, H)
    assert await asyncio.wait_for(waiter, 10) is True


async def test_a_join_is_bounded_and_closing_releases_the_waiters() -> None:
    joins = Joins(asyncio.get_running_loop())
    await posted(joins.started, H)
    assert await joins.join(H, timeout_s=0.01) is False  # the load never settles
    joins.waiting.clear()
    waiter = asyncio.create_task(joins.join(H, timeout_s=30.0))
    await joins.waiting.wait()
    joins.close()  # the engine stops serving: that load will never be settled
    assert await asyncio.wait_for(waiter, 10) is True
    assert not joins.loading(H)


@pytest.fixture
def pool() -> Iterator[DeviceMemory]:
    p = make_pool(num_pages=4)  # 16 blocks
    yield p
    p.close()


async def test_the_join_ends_once_the_prefetched_blocks_are_indexed(pool) -> None:
    """The worker-side DevicePrefetch announces its load to the loop's joins; a join ends
    after the worker settled the load, when the device cache holds the session's blocks."""
    joins = Joins(asyncio.get_running_loop())
    kv = BlockTables(BlockAllocator(pool), LAYERS, BLOCK_SIZE)
    transport = Transport()
    d = DevicePrefetch(kv, 1024, transport, NoRequests(), watch=joins)
    hashes = tuple(f"s-{i}".encode().ljust(16, b".") for i in range(2))
    span = KVSpan(hashes[-1], 0, 2, "dram", 2 * 1024 * LAYERS)
    order = PrefetchOrder(SessionKey("t", "s"), hashes, ReusePlan((span,), "lease", 0, 2))

    def advise() -> None:  # (worker thread) the Prefetch command, then a step begins
        d.add(order)
        d.begin_step()

    await posted(advise)
    (job,) = transport.jobs
    assert joins.loading(hashes[0])
    waiter = asyncio.create_task(joins.join(hashes[0], timeout_s=30.0))

    def kvstore_loads() -> None:  # (the kvstore, through the client) every layer lands
        for layer in range(LAYERS):
            job.readiness.mark_loaded(layer)
        job.readiness.finish()

    await joins.waiting.wait()
    await posted(kvstore_loads)
    assert not waiter.done()  # landed, but not settled: the blocks are not indexed yet
    await posted(d.begin_step)  # (worker thread) the next step settles the load
    assert await asyncio.wait_for(waiter, 10) is True
    assert kv.peek_cached_blocks(list(hashes)) == 2


class Store:
    """A kvstore that holds nothing and writes down what it was asked."""

    attached = True

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def find_stored_prefix(self, session: SessionKey, hashes: list[bytes],
                                 first_block: int, peer: str = "", peer_tokens: int = 0
                                 ) -> StoredPrefix | None:
        self.asked.append(first_block)
        return None

    def release(self, lease_id: str) -> None:
        raise AssertionError("nothing was leased")


class Device:
    """The device cache's peek: how many of the prompt's blocks it holds, when asked."""

    def __init__(self) -> None:
        self.blocks = 0
        self.peeks = 0

    def peek_cached_blocks(self, hashes: list[bytes]) -> int:
        self.peeks += 1
        return min(self.blocks, len(hashes))


class NoSteps:
    snapshot = None


async def test_the_planner_peeks_at_the_device_only_after_the_join() -> None:
    cfg = EngineConfig(block_size=BLOCK_SIZE,
                       offload=OffloadConfig(kvstore_address="kv:1", prefetch_join_s=30.0))
    joins = Joins(asyncio.get_running_loop())
    store, device = Store(), Device()
    planner = ReusePlanner(cfg, store, device, joins, NoSteps(), num_layers=LAYERS)
    prompt = list(range(3 * BLOCK_SIZE + 1))  # 3 full blocks before the last token
    req = PreparedRequest("r", prompt, SamplingParams(), 4, b"seed", 0, "t", "s")
    first = block_hashes(prompt[:3 * BLOCK_SIZE], BLOCK_SIZE, b"seed")[0]
    await posted(joins.started, first)  # an advisory's load of this prefix is under way
    plan = asyncio.create_task(planner.plan(req))
    await asyncio.wait_for(joins.waiting.wait(), 10)
    assert device.peeks == 0 and store.asked == []  # it waits, it does not load twice

    def settled() -> None:  # (worker thread) the prefetch landed and was indexed
        device.blocks = 3
        joins.settled(first)

    await posted(settled)
    assert await asyncio.wait_for(plan, 10) is None  # all of it on device: nothing to load
    assert device.peeks == 1 and store.asked == []
