"""One simulated node's device memory: the engine's own ``BlockAllocator``, keyed by session.

The blocks, refcounts, prefix cache and LRU eviction are the real allocator's; this module
only names the KV (block ``i`` of a session's history, layer group ``g``: the key
``(b"session/i", g)``), takes and releases a request's blocks the way the engine does
(later layer groups first, so they are evicted first), and keeps the blocks prefetched for
advised sessions: held by one reference each and purged through the allocator's
``reclaimer`` when a request needs memory (cooperative memory, Symphony §3.4), higher
layer groups of every session first (``purge_order="layers"``) or whole sessions, the
least recently advised first (``"sessions"``). Without ``cooperative`` nothing is purged:
requests wait until prefetched blocks are used or their advisory ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.kvcache.block_allocator import BlockAllocator, BlockKey


class FlatPages:
    """A ``PageSource`` whose whole budget is one committed page (no elastic capacity)."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks_per_page = self.num_blocks = num_blocks
        self.num_committed_pages = 1
        self.num_uncommitted_blocks = 0

    def grow(self) -> int | None:
        return None

    def release(self, page: int) -> None:
        raise ValueError("the simulated pool does not shrink")

    def is_committed(self, page: int) -> bool:
        return page == 0

    def page_blocks(self, page: int) -> range:
        return range(self.num_blocks)

    def committed_pages(self) -> list[int]:
        return [0]


def key(session_id: str, index: int, group: int) -> BlockKey:
    return (f"{session_id}/{index}".encode(), group)


@dataclass
class Prefetch:
    session_id: str
    advised_at: float
    blocks: list[list[int]] = field(default_factory=list)  # [group][token block]
    start: float = 0.0  # when its transfer began
    per_group_s: float = 0.0  # transfer time of one layer group
    tier: str = ""

    def groups_done(self, now: float) -> int:
        """Layer groups already in device memory at ``now`` (loaded bottom up)."""
        if self.per_group_s <= 0:
            return len(self.blocks)
        return min(len(self.blocks), int((now - self.start) / self.per_group_s + 1e-9))


class NodeMemory:
    def __init__(self, num_blocks: int, groups: int, cooperative: bool = True,
                 purge_order: str = "layers") -> None:
        if purge_order not in ("layers", "sessions"):
            raise ValueError(f"purge_order must be 'layers' or 'sessions', not {purge_order!r}")
        self.alloc = BlockAllocator(FlatPages(num_blocks))
        self.groups = groups
        self.purge_order = purge_order
        self.prefetches: dict[str, Prefetch] = {}
        self.purged_blocks = 0
        if cooperative:
            self.alloc.set_reclaimer(self)

    # -- what is resident -----------------------------------------------------------------

    def resident(self, session_id: str, nblocks: int) -> list[int]:
        """Per token block of the session's history: how many leading layer groups the
        device holds (stops at the first block holding none)."""
        out = []
        for i in range(nblocks):
            k = 0
            while k < self.groups and self.alloc.cached_block(key(session_id, i, k)) is not None:
                k += 1
            if k == 0:
                break
            out.append(k)
        return out

    # -- a request's blocks ---------------------------------------------------------------

    def take(self, session_id: str, reuse: list[int], total_blocks: int
             ) -> list[list[int]] | None:
        """Blocks ``[group][token block]`` for a request of ``total_blocks`` token blocks
        reusing the resident groups ``reuse`` (from ``resident``); None if memory is short
        (then nothing is held)."""
        table: list[list[int | None]] = [[None] * total_blocks for _ in range(self.groups)]
        hits = []
        for i, k in enumerate(reuse):
            for g in range(k):
                b = self.alloc.cached_block(key(session_id, i, g))
                assert b is not None
                table[g][i] = b
                hits.append(b)
        self.alloc.touch(hits)  # first, so that the allocation cannot evict them
        need = self.groups * total_blocks - len(hits)
        new = self.alloc.allocate(need)
        if new is None:
            self.alloc.free(hits)
            return None
        it = iter(new)
        return [[b if b is not None else next(it) for b in row] for row in table]

    def release(self, session_id: str, table: list[list[int]], full_blocks: int) -> None:
        """A request ended: its first ``full_blocks`` token blocks are cached under the
        session's keys; later layer groups are released first (evicted first)."""
        for g in reversed(range(self.groups)):
            row = table[g]
            for i, b in enumerate(row[:full_blocks]):
                self.alloc.cache(b, key(session_id, i, g))
            self.alloc.free(row)

    def forget(self, session_id: str, table: list[list[int]]) -> None:
        """Release blocks without caching them (a request that reuses nothing)."""
        for row in reversed(table):
            self.alloc.free(row)

    # -- prefetch -------------------------------------------------------------------------

    def prefetch(self, p: Prefetch, nblocks: int, reserve: int) -> int:
        """Hold blocks for ``nblocks`` token blocks of ``p``'s session in free device
        memory (evicting plain cache, never what ``reserve`` blocks of the queue need),
        lower layer groups first (``layers``) or all or nothing (``sessions``); how many
        layer groups it got."""
        self.drop_prefetch(p.session_id, expired=False)
        room = self.alloc.num_free + self.alloc.num_evictable - reserve
        groups = min(self.groups, max(0, room) // max(1, nblocks))
        if self.purge_order == "sessions" and groups < self.groups:
            groups = 0
        if groups == 0 or nblocks == 0:
            return 0
        short = groups * nblocks - self.alloc.num_free
        if short > 0:
            self.alloc.evict(short)
        for g in range(groups):
            row = self.alloc.allocate_free(nblocks)
            assert row is not None
            for i, b in enumerate(row):
                self.alloc.cache(b, key(p.session_id, i, g))
            p.blocks.append(row)
        self.prefetches[p.session_id] = p
        return groups

    def settle(self, session_id: str, now: float) -> None:
        """The session's request came: prefetched groups not loaded yet are given up (the
        request loads them), the rest stay cached for its lookup; the prefetch ends."""
        p = self.prefetches.pop(session_id, None)
        if p is None:
            return
        done = p.groups_done(now)
        for g in reversed(range(len(p.blocks))):
            if g >= done:
                self.alloc.discard(p.blocks[g])
            else:
                self.alloc.free(p.blocks[g])

    def drop_prefetch(self, session_id: str, expired: bool) -> None:
        """An advisory ended unfollowed: expired blocks are the first to be evicted."""
        p = self.prefetches.pop(session_id, None)
        if p is not None:
            for row in reversed(p.blocks):
                (self.alloc.free_first if expired else self.alloc.free)(row)

    def reclaimable(self) -> int:
        return sum(len(row) for p in self.prefetches.values() for row in p.blocks)

    def reclaim(self, n: int) -> int:
        """Free ``n`` prefetched blocks (the allocator's reclaimer)."""
        freed = 0
        while freed < n and self.prefetches:
            if self.purge_order == "layers":
                victim = max(self.prefetches.values(),
                             key=lambda p: (len(p.blocks), -p.advised_at))
                rows = [victim.blocks.pop()]
            else:
                victim = min(self.prefetches.values(), key=lambda p: p.advised_at)
                rows = victim.blocks[::-1]
                victim.blocks = []
            for row in rows:
                freed += self.alloc.discard(row)
                self.purged_blocks += len(row)
            if not victim.blocks:
                del self.prefetches[victim.session_id]
        return freed
