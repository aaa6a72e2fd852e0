"""Exact block ids, eviction order and integrity of the block allocator."""

from __future__ import annotations

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.device_memory import DeviceMemory

H1, H2, H3 = b"h1" * 8, b"h2" * 8, b"h3" * 8


def test_fifo_free_list_and_exhaustion(blocks: BlockAllocator) -> None:
    assert blocks.allocate(3) == [0, 1, 2]
    assert blocks.num_committed == 4  # one page committed so far
    assert blocks.allocate(3) == [3, 4, 5]  # the second page is committed on demand
    blocks.check_integrity()
    assert blocks.allocate(3) is None  # only 6, 7 left: nothing handed out
    assert blocks.num_free == 2
    blocks.free([1, 0])
    assert blocks.allocate(3) == [6, 7, 1]  # freed blocks go to the tail
    blocks.check_integrity()


def test_refcounts_and_double_free(blocks: BlockAllocator) -> None:
    (b,) = blocks.allocate(1)
    blocks.touch([b])
    blocks.free([b])
    assert blocks.refcount[b] == 1 and blocks.num_used == 1
    blocks.free([b])
    assert blocks.num_used == 0
    blocks.check_integrity()
    try:
        blocks.free([b])
    except ValueError as e:
        assert "freed more often" in str(e)
    else:
        raise AssertionError("double free was accepted")


def test_cached_blocks_become_evictable_and_can_be_hit(blocks: BlockAllocator) -> None:
    b0, b1 = blocks.allocate(2)
    assert blocks.cache(b0, (H1, 0)) and blocks.cache(b1, (H1, 1))
    blocks.free([b1, b0])
    assert (blocks.num_free, blocks.num_evictable, blocks.num_used) == (2, 2, 0)
    blocks.check_integrity()
    assert blocks.cached_block((H1, 0)) == b0
    blocks.touch([b0])  # a prefix hit takes it back out of the evictable list
    assert blocks.num_evictable == 1 and blocks.refcount[b0] == 1
    blocks.check_integrity()


def test_a_second_block_with_the_same_key_stays_uncached(blocks: BlockAllocator) -> None:
    a, b = blocks.allocate(2)
    assert blocks.cache(a, (H1, 0))
    assert not blocks.cache(b, (H1, 0))
    blocks.free([a, b])
    assert blocks.num_evictable == 1 and blocks.cached_block((H1, 0)) == a
    blocks.check_integrity()


def test_eviction_is_lru_then_later_layers_first(kv_pool: DeviceMemory) -> None:
    blocks = BlockAllocator(kv_pool)
    older = blocks.allocate(4)  # seq A: blocks of layers 0, 1 for hashes H1, H2
    newer = blocks.allocate(4)  # seq B
    for i, (h, layer) in enumerate([(H1, 0), (H2, 0), (H1, 1), (H2, 1)]):
        blocks.cache(older[i], (h, layer))
        blocks.cache(newer[i], (h + b"b", layer))
    # Released as the KV manager does: later layers first, later blocks first.
    blocks.free([older[3], older[2], older[1], older[0]])
    blocks.free([newer[3], newer[2], newer[1], newer[0]])
    assert blocks.num_free == 0 and blocks.num_evictable == 8
    order = [blocks.allocate(1)[0] for _ in range(8)]
    assert order == [3, 2, 1, 0, 7, 6, 5, 4]
    assert blocks.cached_block((H1, 0)) is None and blocks.num_evictable == 0
    blocks.check_integrity()


def test_explicit_evict_returns_keys_in_order(blocks: BlockAllocator) -> None:
    a, b = blocks.allocate(2)
    blocks.cache(a, (H3, 0))
    blocks.cache(b, (H3, 1))
    blocks.free([b, a])
    assert blocks.evict(1) == [(H3, 1)]
    assert blocks.num_evictable == 1 and blocks.num_free == 3
    blocks.check_integrity()


def test_shrink_prefers_free_pages_then_drops_cache(kv_pool: DeviceMemory) -> None:
    blocks = BlockAllocator(kv_pool)
    got = blocks.allocate(8)
    for b in got[:4]:
        blocks.cache(b, (bytes([b]) * 16, 0))
    blocks.free(got)  # page 0: evictable, page 1: free
    assert blocks.shrink(1) == 1
    assert kv_pool.committed_pages() == [0] and blocks.num_evictable == 4
    blocks.check_integrity()
    assert blocks.shrink(1) == 1  # now the cached page goes too
    assert kv_pool.committed_pages() == [] and blocks.cached_block((bytes([0]) * 16, 0)) is None
    blocks.check_integrity()


def test_shrink_never_releases_used_blocks(blocks: BlockAllocator) -> None:
    blocks.allocate(5)  # page 0 full, page 1 holds one used block
    assert blocks.shrink(2) == 0
    blocks.check_integrity()
