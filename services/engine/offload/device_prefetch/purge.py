"""Which prefetched layers give way, and in which order (Symphony §3.4).

    LAYERS order:    the highest layer held across sessions first, then the lower
                     priority, then the least recently advised session
    SESSIONS order:  whole sessions, the lower priority and then the least recently
                     advised first (an ablation, §4.5)

Running requests (the allocator's ``reclaim``) may take any prefetched layer. To make
room for another prefetch only layers above the one being granted go, of sessions of no
higher priority, plus (``straight``, the priority policy) any layer of lower-priority
sessions; never a session granted a layer in the same pass. A top layer a request uses
frees nothing (its blocks stay the request's), so it is not purged.
"""

from __future__ import annotations

from collections.abc import Collection

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.offload.device_prefetch.orders import LAYERS, Advised


class Purger:
    """Gives prefetched layers back to the allocator; counts them per layer."""

    def __init__(self, blocks: BlockAllocator, num_layers: int, order: str = LAYERS) -> None:
        self.blocks = blocks
        self.order = order
        self.purged_by_layer = [0] * num_layers

    def purgeable(self, sessions: Collection[Advised], above_layer: int, for_priority: int,
                  straight: bool, busy: Collection[int]) -> int:
        """Blocks ``purge`` with these rules could free at most (an estimate from above:
        a top layer a request uses stops its session's purge there)."""
        rc, n = self.blocks.refcount, 0
        for s in sessions:
            if id(s) in busy or s.loading is not None or s.order.priority > for_priority:
                continue
            lowest = 0 if straight and s.order.priority < for_priority else above_layer + 1
            n += sum(rc[b] == 1 for blocks in s.held[lowest:] for b in blocks)
        return n

    def purge(self, sessions: Collection[Advised], n: int, above_layer: int,
              for_priority: int | None = None, straight: bool = False,
              busy: Collection[int] = ()) -> int:
        """Drop top layers of ``sessions`` in purge order until ``n`` blocks are free; how
        many were freed. ``for_priority`` None: for running requests (any layer may go);
        else to make room for a prefetch of that priority (see the module docstring)."""
        rc = self.blocks.refcount

        def may_go(s: Advised) -> bool:
            if id(s) in busy:
                return False
            if for_priority is None:
                return True
            p = s.order.priority
            if straight and p < for_priority:
                return True
            return p <= for_priority and s.top_layer > above_layer

        def frees_some(s: Advised) -> bool:  # (a top layer a request uses frees nothing)
            return any(rc[b] == 1 for b in s.held[-1])

        freed = 0
        while freed < n:
            tops = [s for s in sessions if s.held and s.loading is None
                    and may_go(s) and frees_some(s)]
            if not tops:
                break
            if self.order == LAYERS:
                s = min(tops, key=lambda s: (-s.top_layer, s.order.priority, s.advised_at))
            else:  # whole sessions, the least recently advised first
                s = min(tops, key=lambda s: (s.order.priority, s.advised_at))
            layer = s.top_layer
            blocks = s.held.pop()
            self.purged_by_layer[layer] += len(blocks)
            freed += self.blocks.discard(blocks)
        return freed
