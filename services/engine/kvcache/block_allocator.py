"""Block allocator over the KV pool: free list, refcounts, and a cache of computed blocks.

Every committed block is in exactly one place:

    free       refcount 0, holds nothing reusable          (O(1) FIFO list)
    used       refcount > 0, in some sequence's block table
    evictable  refcount 0, holds the KV of a known (hash, layer); reusable until evicted

so ``free + used + evictable == committed``. Blocks of uncommitted pages are nowhere.

Evictable blocks leave in LRU order of release. A sequence releases its blocks in the
order the caller gives; the KV manager gives later layers first, so among blocks released
together the higher layers are evicted first (Symphony: "later layers first, then the
least recently used session").

Blocks prefetched for advised sessions are *used* here, held by one reference of the
device prefetch (offload/device_prefetch/). When an allocation finds nothing free or
evictable left, the ``Reclaimer`` (that prefetch, wired in by whoever builds both: the
engine core) is asked to purge some of them (cooperative memory, Symphony §3.4):
prefetched KV gives way to running requests before any is preempted.

Running out is normal: ``allocate`` returns None and the caller preempts or waits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

BlockKey = tuple[bytes, int]  # (content hash, layer)


class PageSource(Protocol):
    """Committed capacity in pages of ``blocks_per_page`` blocks (``DeviceMemory``)."""

    blocks_per_page: int
    num_blocks: int
    num_committed_pages: int

    @property
    def num_uncommitted_blocks(self) -> int: ...

    def grow(self) -> int | None: ...

    def release(self, page: int) -> None: ...

    def is_committed(self, page: int) -> bool: ...

    def page_blocks(self, page: int) -> range: ...

    def committed_pages(self) -> list[int]: ...


class Reclaimer(Protocol):
    """Used blocks held by someone who gives them up when the allocator runs dry."""

    def reclaimable(self) -> int:
        """How many blocks ``reclaim`` could free now, at most."""
        ...

    def reclaim(self, n: int) -> int:
        """Free up to ``n`` held blocks (``discard``); how many became free."""
        ...


class BlockAllocator:
    def __init__(self, pages: PageSource) -> None:
        self._pages = pages
        n = pages.num_blocks
        self.refcount = [0] * n
        self.key: list[BlockKey | None] = [None] * n
        self._free: OrderedDict[int, None] = OrderedDict()
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockKey, int] = {}
        self.num_used = 0
        self._reclaimer: Reclaimer | None = None
        for page in pages.committed_pages():
            self._free.update(dict.fromkeys(pages.page_blocks(page)))

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> None:
        """Who gives held blocks back when an allocation runs dry (None: nobody)."""
        self._reclaimer = reclaimer

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_committed(self) -> int:
        return self._pages.num_committed_pages * self._pages.blocks_per_page

    @property
    def num_total(self) -> int:
        return self._pages.num_blocks

    def num_available(self) -> int:
        """Blocks an ``allocate`` could hand out now (free, evictable, or committable)."""
        return len(self._free) + len(self._evictable) + self._pages.num_uncommitted_blocks

    # ---- allocation ---------------------------------------------------------------------
    def num_free_or_committable(self) -> int:
        """Blocks an ``allocate_free`` could hand out now (nothing evicted)."""
        return len(self._free) + self._pages.num_uncommitted_blocks

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with refcount 1, or None (nothing changed) if there are not enough.

        Order of preference: the free list, then a newly committed page, then the least
        recently released cached block, then blocks the reclaimer purges.
        """
        short = n - self.num_available()
        # (only when purging can make up the difference: else nothing is purged in vain)
        r = self._reclaimer
        if short > 0 and r is not None and r.reclaimable() >= short:
            r.reclaim(short)
        if n > self.num_available():
            return None
        out: list[int] = []
        while len(out) < n:
            block = self._take_one()
            if block is None:  # committing failed after all: undo and report exhaustion
                self.free(out)
                return None
            out.append(block)
        return out

    def allocate_free(self, n: int) -> list[int] | None:
        """``n`` blocks from the free list and uncommitted pages only (nothing cached is
        evicted, nothing purged), or None: what prefetch may be granted."""
        if n > self.num_free_or_committable():
            return None
        out: list[int] = []
        while len(out) < n:
            if not self._free:
                page = self._pages.grow()
                if page is None:
                    break
                self._free.update(dict.fromkeys(self._pages.page_blocks(page)))
            block, _ = self._free.popitem(last=False)
            self.refcount[block] = 1
            self.num_used += 1
            out.append(block)
        if len(out) < n:
            self.free(out)
            return None
        return out

    def _take_one(self) -> int | None:
        if not self._free and self._pages.num_uncommitted_blocks:
            page = self._pages.grow()
            if page is not None:
                self._free.update(dict.fromkeys(self._pages.page_blocks(page)))
        if self._free:
            block, _ = self._free.popitem(last=False)
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        else:
            return None
        self.refcount[block] = 1
        self.num_used += 1
        return block

    def _uncache(self, block: int) -> None:
        key = self.key[block]
        if key is not None:
            del self._index[key]
            self.key[block] = None

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit)."""
        for b in blocks:
            if self.refcount[b] == 0:
                del self._evictable[b]  # only cached blocks can be hit with refcount 0
                self.num_used += 1
            self.refcount[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in order; unreferenced cached blocks become
        evictable (the first given is evicted first), others free."""
        for b in blocks:
            if self._unref(b):
                if self.key[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free[b] = None

    def discard(self, blocks: Iterable[int]) -> int:
        """Drop one reference to each block; one left unreferenced loses its cached KV and
        is free at once (a purged or invalidated prefetch). How many became free."""
        freed = 0
        for b in blocks:
            if self._unref(b):
                self._uncache(b)
                self._free[b] = None
                freed += 1
        return freed

    def _unref(self, b: int) -> bool:
        """Drop one reference to ``b``; whether it has none left (it is then unplaced:
        the caller puts it on the free or the evictable list)."""
        rc = self.refcount[b] - 1
        if rc < 0:
            raise ValueError(f"block {b} freed more often than allocated")
        self.refcount[b] = rc
        if rc:
            return False
        self.num_used -= 1
        return True

    def free_first(self, blocks: Iterable[int]) -> None:
        """Like ``free``, but unreferenced cached blocks go to the front of the eviction
        order: the first to go (an expired advisory's prefetch, Symphony §3.6)."""
        blocks = list(blocks)
        self.free(blocks)
        for b in reversed(blocks):
            if b in self._evictable:
                self._evictable.move_to_end(b, last=False)

    # ---- prefix cache -------------------------------------------------------------------
    def cached_block(self, key: BlockKey) -> int | None:
        """The block holding the KV named by ``key`` (None: not cached)."""
        return self._index.get(key)

    def cache(self, block: int, key: BlockKey) -> bool:
        """Record that a used block holds the KV named by ``key``. False if another block
        already does (this one then stays uncached and is freed normally)."""
        if self.key[block] is not None or key in self._index:
            return self.key[block] == key
        self._index[key] = block
        self.key[block] = key
        return True

    def evict(self, n: int) -> list[BlockKey]:
        """Drop up to ``n`` evictable blocks (LRU first) into the free list; their keys."""
        dropped: list[BlockKey] = []
        while self._evictable and len(dropped) < n:
            block, _ = self._evictable.popitem(last=False)
            key = self.key[block]
            assert key is not None, "an evictable block is cached under a key"
            dropped.append(key)
            self._uncache(block)
            self._free[block] = None
        return dropped

    # ---- elastic capacity ---------------------------------------------------------------
    def shrink(self, max_pages: int) -> int:
        """Release up to ``max_pages`` committed pages, highest first: pages with only free
        blocks, then pages whose blocks are free or evictable (dropping that cache)."""
        released = 0
        for allow_cached in (False, True):
            for page in reversed(self._pages.committed_pages()):
                if released >= max_pages:
                    return released
                blocks = self._pages.page_blocks(page)
                if all(self._releasable(b, allow_cached) for b in blocks):
                    self._forget(blocks)
                    self._pages.release(page)
                    released += 1
        return released

    def _forget(self, blocks: Iterable[int]) -> None:
        """Drop releasable ``blocks`` (free, or cached and unused) from the free list and
        the cache, before their page is released."""
        for b in blocks:
            if b in self._evictable:
                del self._evictable[b]
                self._uncache(b)
            else:
                del self._free[b]

    def release_from(self, first_page: int) -> bool:
        """Release every committed page from ``first_page`` up, dropping the cache they
        hold, if none holds a used block (lent KV capacity given back, MIRAGE §5.5);
        False, nothing changed, if one does."""
        pages = [p for p in self._pages.committed_pages() if p >= first_page]
        blocks = [b for p in pages for b in self._pages.page_blocks(p)]
        if not all(self._releasable(b, True) for b in blocks):
            return False
        self._forget(blocks)
        for p in pages:
            self._pages.release(p)
        return True

    def _releasable(self, block: int, allow_cached: bool) -> bool:
        return block in self._free or (allow_cached and block in self._evictable)

    # ---- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the accounting is inconsistent."""
        committed: set[int] = set()
        for page in self._pages.committed_pages():
            committed.update(self._pages.page_blocks(page))
        free, evictable = set(self._free), set(self._evictable)
        used = {b for b, rc in enumerate(self.refcount) if rc > 0}
        assert all(rc >= 0 for rc in self.refcount), "negative refcount"
        assert not (free & evictable) and not (free & used) and not (evictable & used), (
            "a block is in two places"
        )
        assert free | evictable | used == committed, "blocks lost or outside committed pages"
        assert len(free) + len(evictable) + len(used) == self.num_committed
        assert self.num_used == len(used), f"used count {self.num_used} != {len(used)}"
        for key, b in self._index.items():
            assert self.key[b] == key, f"index entry {key!r} -> {b} disagrees"
        assert sum(k is not None for k in self.key) == len(self._index)
        assert all(self.key[b] is None for b in free), "a free block still has a key"
        assert all(self.key[b] is not None for b in evictable), "an evictable block has no key"
