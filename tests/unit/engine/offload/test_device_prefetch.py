"""The device prefetch's memory rules (Symphony §3.4, §3.6) on a real allocator: lower
layers of every advised session before higher layers of any, purges later layers first
then the least recently advised session, expired advisories first to go, invalidation
frees at once, a request admitted on the blocks follows the advisory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.block_tables import BlockTables
from services.engine.offload.device_prefetch import (
    DEVICE_PARTIAL,
    DEVICE_PREFETCHED,
    DevicePrefetch,
    PrefetchOrder,
)
from services.engine.offload.jobs import LoadJob, SaveJob
from services.engine.reuse_plan import SKIP, ReusePlan
from services.engine.sequence import Sequence
from shared.kv_layout import KVSpan
from shared.session_key import SessionKey

from ..conftest import BLOCK_SIZE, make_pool

LAYERS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Transport:
    """Loads wait in ``jobs`` (a test lands them); released leases are written down."""

    def __init__(self) -> None:
        self.jobs: list[LoadJob] = []
        self.released: list[str] = []

    def start_load(self, job: LoadJob) -> None:
        self.jobs.append(job)

    def start_save(self, job: SaveJob) -> None:
        raise AssertionError("the device prefetch saves nothing")

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)


class Watch:
    """Counts the loads into the device under way per first block hash, as the event
    loop's PrefetchJoins does."""

    def __init__(self) -> None:
        self.under_way: dict[bytes, int] = {}

    def started(self, first_hash: bytes) -> None:
        self.under_way[first_hash] = self.under_way.get(first_hash, 0) + 1

    def settled(self, first_hash: bytes) -> None:
        self.under_way[first_hash] -= 1
        if not self.under_way[first_hash]:
            del self.under_way[first_hash]


class NoRequests:
    """No request runs or waits: nothing is reserved, no session is here."""

    def blocks_wanted_next_step(self) -> int:
        return 0

    def sessions(self) -> set[SessionKey]:
        return set()


def make_book(pool, cooperative: bool = True, **knobs) -> tuple[DevicePrefetch, list[LoadJob],
                                                                 Clock]:
    """A device prefetch over ``pool``, wired into its allocator as whoever builds both
    does (the engine core): as the allocator's reclaimer, when cooperative."""
    blocks = BlockAllocator(pool)
    kv = BlockTables(blocks, LAYERS, BLOCK_SIZE)
    clock = Clock()
    transport = Transport()
    d = DevicePrefetch(kv, 1024, transport, NoRequests(), watch=Watch(), clock=clock,
                       cooperative=cooperative, **knobs)
    if cooperative:
        blocks.set_reclaimer(d)
    return d, transport.jobs, clock


def layers(d: DevicePrefetch, sid: str) -> int:
    """The layers of session ``sid`` (tenant "t") held on the device."""
    return d.resident_layers(SessionKey("t", sid))


@pytest.fixture
def book() -> Iterator[tuple[DevicePrefetch, list[LoadJob], Clock]]:
    pool = make_pool(num_pages=4)  # 16 blocks
    yield make_book(pool)
    pool.close()


def order(sid: str, blocks: int, priority: int = 0, ttl_s: float = 30.0) -> PrefetchOrder:
    hashes = tuple(f"{sid}-{i}".encode().ljust(16, b".") for i in range(blocks))
    span = KVSpan(hashes[-1], 0, blocks, "dram", blocks * 1024 * LAYERS)
    return PrefetchOrder(SessionKey("t", sid), hashes,
                         ReusePlan((span,), f"lease-{sid}", 0, blocks),
                         priority, ttl_s)


def finish(jobs: list[LoadJob]) -> None:
    """The kvstore loads every job's layers (what LoadIntoPool reports)."""
    for job in jobs:
        for layer in range(LAYERS):
            job.readiness.mark_loaded(layer)
        job.readiness.finish()
    jobs.clear()


def prefetched(d: DevicePrefetch, jobs: list[LoadJob], o: PrefetchOrder) -> None:
    """``o``'s session advised and its loads landed."""
    d.add(o)
    d.begin_step()
    finish(jobs)
    d.begin_step()


def admitted_seq(d: DevicePrefetch, first_blocks: list[list[int]]) -> Sequence:
    """A request of session ``a`` admitted on ``first_blocks`` ([block][layer])."""
    seq = Sequence("r", [1] * 9, None, b"", 20, 0, LAYERS,  # type: ignore[arg-type]
                   tenant="t", session_id="a")
    for blocks in first_blocks:
        for layer, b in enumerate(blocks):
            seq.block_tables[layer].append(b)
    return seq


def layers_in(job: LoadJob, blocks: int) -> list[int]:
    return [ly for ly in range(LAYERS)
            if any(b != SKIP for b in job.block_ids[ly * blocks:(ly + 1) * blocks])]


def advise_old_then_new(d: DevicePrefetch, jobs: list[LoadJob], clock: Clock) -> None:
    """Sessions "old" then "new" advised a second apart, each on 2 blocks: every layer
    of both lands and fills the 16 blocks."""
    d.add(order("old", 2))
    clock.now += 1
    d.add(order("new", 2))
    d.begin_step()
    finish(jobs)
    d.begin_step()
    assert layers(d, "old") == layers(d, "new") == 4


def test_plenty_of_memory_puts_every_layer_on_device(book) -> None:
    d, jobs, _ = book
    d.add(order("a", 2))
    d.begin_step()
    assert len(jobs) == 1 and layers_in(jobs[0], 2) == [0, 1, 2, 3]
    assert jobs[0].plan.lease_id == "lease-a"
    finish(jobs)
    d.begin_step()
    assert layers(d, "a") == LAYERS
    for ly in range(LAYERS):  # indexed under the prompt's content hashes
        assert d.blocks.cached_block((order("a", 2).hashes[0], ly)) is not None
    d.blocks.check_integrity()


def test_lower_layers_of_every_session_before_higher_layers_of_any(book) -> None:
    d, jobs, _ = book  # 16 blocks: sessions of 3 blocks per layer
    d.add(order("a", 3))
    d.begin_step()
    finish(jobs)
    d.begin_step()
    assert layers(d, "a") == 4  # 12 of 16 blocks
    d.add(order("b", 3))
    d.begin_step()  # b's layer 0 needs 3 blocks: 4 are free
    finish(jobs)
    d.begin_step()  # b's layer 1: a's layer 3 is purged for it (a higher layer); b's
    finish(jobs)  # layer 2 would need a's layer 2 (not higher): b waits for free memory
    d.begin_step()
    assert (layers(d, "a"), layers(d, "b")) == (3, 2)
    assert d.purged_by_layer == [0, 0, 0, 3]
    d.blocks.check_integrity()


def test_running_requests_purge_later_layers_first_then_least_recently_advised(book) -> None:
    d, jobs, clock = book
    advise_old_then_new(d, jobs, clock)  # 16 blocks
    got = d.blocks.allocate(2)  # a running request needs memory: the pool is full
    assert got is not None
    assert (layers(d, "old"), layers(d, "new")) == (3, 4)
    d.blocks.allocate(2)
    assert (layers(d, "old"), layers(d, "new")) == (3, 3)
    d.blocks.allocate(6)
    assert (layers(d, "old"), layers(d, "new")) == (1, 2)
    assert d.purged_by_layer == [0, 2, 4, 4]


def test_expired_advisories_go_first_and_invalidation_frees_at_once(book) -> None:
    d, jobs, clock = book
    d.add(order("spurious", 2, ttl_s=5))
    d.add(order("kept", 2, ttl_s=60))
    d.begin_step()
    finish(jobs)
    d.begin_step()
    clock.now += 10
    d.begin_step()  # the spurious advisory expired: its blocks are evictable, first to go
    assert ("t", "spurious") not in d.sessions and d.outcomes == {"expired": 1}
    assert d.blocks.num_evictable == 8 and d.wasted_bytes == 8 * 1024
    d.blocks.allocate(8)
    assert layers(d, "kept") == 4  # nothing of the followed session went
    assert d.end(SessionKey("t", "kept"))
    assert d.blocks.num_free == 8 and d.blocks.num_evictable == 0  # freed, not cached
    d.blocks.check_integrity()


def test_a_request_admitted_on_the_blocks_follows_the_advisory(book) -> None:
    d, jobs, _ = book
    o = order("a", 2)
    prefetched(d, jobs, o)
    cached = [[d.blocks.cached_block((h, ly)) for ly in range(LAYERS)] for h in o.hashes]
    seq = admitted_seq(d, [])
    d.kv.allocate(seq, 1, cached)  # type: ignore[arg-type]
    d.admitted(seq)
    assert seq.offload.prefetched == DEVICE_PREFETCHED and d.outcomes == {"followed": 1}
    assert not d.sessions and d.wasted_bytes == 0
    d.kv.free(seq)
    assert d.blocks.num_evictable == 8  # the request's cache now
    d.blocks.check_integrity()


def test_partial_residency_is_labelled(book) -> None:
    d, jobs, _ = book
    o = order("a", 2)
    prefetched(d, jobs, o)
    d.blocks.allocate(12)  # 8 free, then layers 3 and 2 are purged
    assert layers(d, "a") == 2
    lower = [d.blocks.cached_block((o.hashes[0], ly)) for ly in range(2)]
    seq = admitted_seq(d, [lower])  # type: ignore[list-item]
    d.admitted(seq)
    assert seq.offload.prefetched == DEVICE_PARTIAL


def test_a_failed_load_keeps_the_layers_that_arrived(book) -> None:
    d, jobs, _ = book
    d.add(order("a", 2))
    d.begin_step()
    (job,) = jobs
    job.readiness.mark_loaded(0)
    job.readiness.mark_loaded(1)
    job.readiness.fail(2, "chunk missing")
    job.readiness.finish()
    jobs.clear()
    d.begin_step()
    assert layers(d, "a") == 2
    assert not jobs  # no retry of a session whose copy failed
    d.blocks.check_integrity()
    assert sorted(d.held_blocks()) == sorted(
        b for blocks in d.sessions[("t", "a")].held for b in blocks)


def test_renewing_an_advisory_keeps_its_blocks(book) -> None:
    d, jobs, clock = book
    released = d.transport.released
    d.add(order("a", 2, ttl_s=5))
    d.begin_step()
    finish(jobs)
    clock.now += 4
    d.add(order("a", 2, ttl_s=5))  # the user typed again
    assert released == ["lease-a"]  # the new lookup's lease: the blocks are there
    clock.now += 4
    d.begin_step()
    assert layers(d, "a") == 4


def test_sixty_percent_spurious_advisories_are_purged_before_the_real_ones(book) -> None:
    """10 advised sessions of 1 block a layer fill the 16 blocks (layer 0 of all ten, then
    layer 1 of six); 6 are spurious and expire: their blocks go to the 4 that do arrive,
    and under pressure those lose only upper layers."""
    d, jobs, clock = book
    real = [f"r{i}" for i in range(4)]
    spurious = [f"s{i}" for i in range(6)]
    for sid in [spurious[0], real[0], spurious[1], spurious[2], real[1], spurious[3],
                real[2], spurious[4], spurious[5], real[3]]:
        d.add(order(sid, 1, ttl_s=5 if sid in spurious else 60))
        clock.now += 0.1
    d.begin_step()
    finish(jobs)
    d.begin_step()
    assert d.blocks.num_free_or_committable() == 0
    assert all(layers(d, s) >= 1 for s in real)
    assert any(layers(d, s) < LAYERS for s in real)
    clock.now += 6
    d.begin_step()  # unfollowed within their TTL: plain cache, the first to go, and
    finish(jobs)  # the real sessions take its place
    d.begin_step()
    assert d.outcomes == {"expired": 6} and d.wasted_bytes > 0
    assert all(layers(d, s) == LAYERS for s in real)
    assert sum(d.purged_by_layer) == 0  # nothing of an arriving session went for them
    assert d.blocks.allocate(4) is not None  # a running request: top layers go, never layer 0
    assert sum(d.purged_by_layer) == 4 and d.purged_by_layer[0] == 0
    d.blocks.check_integrity()


def test_at_one_layer_lower_priority_sessions_are_purged_first(book) -> None:
    d, jobs, clock = book
    d.add(order("paid", 2, priority=5))
    clock.now += 1
    d.add(order("free", 2, priority=0))  # more recently advised, but lower priority
    d.begin_step()
    finish(jobs)
    d.begin_step()  # 16 of 16 blocks held
    held = []
    for _ in range(3):
        d.blocks.allocate(2)  # one top layer of 2 blocks at a time
        held.append((layers(d, "paid"), layers(d, "free")))
    assert held == [(4, 3), (3, 3), (3, 2)]


def test_prefetch_evicts_plain_cache_and_only_straight_sessions_purge_lower_layers(
        book) -> None:
    d, jobs, _ = book
    cache = d.blocks.allocate(16)
    assert cache is not None
    for i, b in enumerate(cache):
        d.blocks.cache(b, (f"c{i}".encode(), 0))
    d.blocks.free(cache)  # the device is full of another session's cache
    d.add(order("low", 4))  # 4 blocks a layer: the plain cache makes way, LRU first
    d.begin_step()
    finish(jobs)
    d.begin_step()
    assert layers(d, "low") == LAYERS and d.blocks.num_evictable == 0
    d.add(order("high", 4, priority=5))  # balanced: only layers above its own may go
    d.begin_step()
    finish(jobs)
    d.begin_step()
    assert (layers(d, "low"), layers(d, "high")) == (2, 2)
    o = order("vip", 4, priority=9)  # the priority policy: straight to device
    d.add(PrefetchOrder(o.session, o.hashes, o.plan, 9, 30.0, straight=True))
    d.begin_step()
    finish(jobs)
    d.begin_step()
    assert layers(d, "vip") == LAYERS
    assert layers(d, "low") == 0 and layers(d, "high") == 0
    d.blocks.check_integrity()


def test_a_session_replaced_while_loading_gives_its_blocks_back(book) -> None:
    d, jobs, _ = book
    d.add(order("a", 2))
    d.begin_step()
    (job,) = jobs
    jobs.clear()
    longer = order("a", 3)  # the next turn was saved meanwhile: a longer sequence
    d.add(longer)
    held = sorted(d.held_blocks())
    assert len(held) == 2 * LAYERS  # the old load's blocks are still accounted for
    assert d.watch.under_way == {longer.hashes[0]: 1}  # (the old one's first block)
    for layer in range(LAYERS):
        job.readiness.mark_loaded(layer)
    job.readiness.finish()
    d.begin_step()  # the old entry settles and leaves; the new one fills
    finish(jobs)
    d.begin_step()
    assert layers(d, "a") == LAYERS and d.outcomes == {"replaced": 1}
    assert len(d.held_blocks()) == 3 * LAYERS and d.watch.under_way == {}
    refs = [0] * d.blocks.num_total
    for b in d.held_blocks():
        refs[b] += 1
    assert all(d.blocks.refcount[b] == refs[b] for b in range(d.blocks.num_total))
    d.blocks.check_integrity()


def test_a_straight_prefetch_adopts_cached_blocks_before_evicting(book) -> None:
    d, jobs, _ = book
    o = order("vip", 2, priority=5)
    # layer 0 of the session's first block is in the device cache, the pool otherwise full
    # of other cache: evicting must not take the block the prefetch adopts.
    blocks = d.blocks.allocate(16)
    assert blocks is not None
    d.blocks.cache(blocks[0], (o.hashes[0], 0))
    for i, b in enumerate(blocks[1:]):
        d.blocks.cache(b, (f"c{i}".encode(), 0))
    d.blocks.free(blocks)
    d.add(PrefetchOrder(o.session, o.hashes, o.plan, 5, 30.0, straight=True))
    d.begin_step()
    (job,) = jobs
    assert job.block_ids[0] == SKIP and blocks[0] not in job.block_ids  # adopted, not loaded
    assert len(set(job.block_ids) - {SKIP}) == 2 * LAYERS - 1
    finish(jobs)
    d.begin_step()
    assert layers(d, "vip") == LAYERS
    d.blocks.check_integrity()


def test_no_purge_in_vain(book) -> None:
    """Purges happen only when they make the room: else the other session would reload
    its layers next step, to be purged again (a loop of copies)."""
    d, jobs, clock = book
    prefetched(d, jobs, order("small", 2))  # 8 of 16 blocks, every layer
    clock.now += 1
    d.add(order("big", 12))  # 12 blocks a layer
    for _ in range(3):
        d.begin_step()
        finish(jobs)
    # big's layer 0: 8 free + small's layers 3 and 2 (lower layers of all first)
    assert (layers(d, "big"), layers(d, "small")) == (1, 2)
    assert d.purged_by_layer == [0, 0, 2, 2]
    # big's layer 1 would need 12: nothing above layer 1 is left to purge, so nothing is,
    # and small cannot take its layer 2 back from big's layer 0: stable, no copies.
    for _ in range(3):
        d.begin_step()
        assert not jobs
    assert d.purged_by_layer == [0, 0, 2, 2]
    d.blocks.check_integrity()


@pytest.fixture
def ablated() -> Iterator:
    """A book like ``book``'s with the ablation knobs given."""
    pools = []

    def make(**knobs) -> tuple[DevicePrefetch, list[LoadJob], Clock]:
        pools.append(pool := make_pool(num_pages=4))  # 16 blocks
        return make_book(pool, **knobs)

    yield make
    for pool in pools:
        pool.close()


def test_without_cooperation_running_requests_cannot_take_prefetched_blocks(ablated) -> None:
    # The §4.5 ablation: the same full pool as above, but a running request finds no
    # block (it would wait) instead of purging a prefetched layer.
    d, jobs, clock = ablated(cooperative=False)
    advise_old_then_new(d, jobs, clock)
    assert d.blocks.allocate(2) is None
    assert d.purged_by_layer == [0] * LAYERS


def test_the_sessions_order_fills_and_purges_whole_sessions(ablated) -> None:
    d, jobs, clock = ablated(purge_order="sessions")
    d.add(order("a", 3))
    d.begin_step()
    finish(jobs)
    d.begin_step()
    clock.now += 1
    d.add(order("b", 3))  # the newer session takes all of its layers from the older one
    for _ in range(5):
        d.begin_step()
        finish(jobs)
    assert (layers(d, "a"), layers(d, "b")) == (1, 4)
    assert d.purged_by_layer == [0, 3, 3, 3]
    d.blocks.allocate(4)  # running requests: the least recently advised session first
    assert (layers(d, "a"), layers(d, "b")) == (0, 4)
    assert d.purged_by_layer == [3, 3, 3, 3]


def test_a_tool_pause_purged_under_pressure_is_prefetched_again_before_the_return(
        book) -> None:
    """Issue 41: a session waiting on a tool holds its blocks as prefetched ones (a soft
    pin). Running requests take its later layers first; once they end, while the
    advisory still runs (the tool has not returned), the purged layers are loaded again
    from the kvstore's DRAM copy, and the engine steps for it though nothing else runs,
    so the tool result's turn finds every layer on device."""
    d, jobs, clock = book
    o = order("a", 2, ttl_s=30)  # expected back within its advisory's life
    prefetched(d, jobs, o)
    assert not d.fill_pending()  # every layer there: nothing to do
    taken = d.blocks.allocate(14)  # running requests: 8 free, then 3 top layers go
    assert taken is not None and layers(d, "a") == 1
    assert d.purged_by_layer == [0, 2, 2, 2]  # later layers first (blocks per layer)
    assert not d.fill_pending()  # no room: the engine need not step for it
    d.blocks.free(taken)  # the requests ended; the tool is still running
    clock.now += 5
    assert d.fill_pending()  # room again: one more step, idle or not
    d.begin_step()
    (job,) = jobs
    assert job.plan.lease_id == ""  # the first load's lease is spent: the tiers are searched
    assert layers_in(job, 2) == [1, 2, 3]  # only what was purged
    finish(jobs)
    d.begin_step()
    assert layers(d, "a") == LAYERS and not d.fill_pending()
    seq = admitted_seq(d, [[d.blocks.cached_block((h, ly)) for ly in range(LAYERS)]  # type: ignore[misc]
                           for h in o.hashes])
    d.admitted(seq)  # the tool's result arrives: a device hit on every layer
    assert seq.offload.prefetched == DEVICE_PREFETCHED and d.outcomes == {"followed": 1}
    d.blocks.check_integrity()
