"""The Tensor Allocator (Tangram §3.2): places a model's missing tensors in the arena's
free regions, moving resident tensors only when packing fails.

    place(items):
      Algorithm 1 (packing.py) splits the region list into subspaces, each with its share
      of the tensors
      -> each subspace: best fit of its tensors (largest first) into its free regions
         -> what does not fit: compact the subspace (slide its movable tensors to its
            start, joining its free space) and best-fit again
      -> tensors still without a place: best fit anywhere, then a compaction of the whole
         arena, then ``NoRoom``
Every byte moved is counted (``Placement.moved_bytes``): compaction is the cost the
two-stage heuristic exists to avoid. Tensors an engine maps now are never moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.nodemgr.reuse_store.packing import Item, partitioned_gain_packing
from services.nodemgr.reuse_store.regions import Move, RegionList


class NoRoom(RuntimeError):
    """The arena cannot hold the tensors (even after compaction): evict more first."""


@dataclass
class Placement:
    offsets: dict[str, int] = field(default_factory=dict)  # key -> offset in the arena
    moves: list[Move] = field(default_factory=list)  # to apply to the bytes, in order
    packed: bool = False  # Algorithm 1 ran (the tensors did not all fit as they were)
    compactions: int = 0
    merge_cost: int = 0  # Algorithm 1's M

    @property
    def moved_bytes(self) -> int:
        return sum(m.size for m in self.moves)


def best_fit(regions: RegionList, item: Item, start: int = 0, stop: int | None = None
             ) -> int | None:
    """Index of the smallest free region of regions[start:stop] that holds ``item``."""
    stop = len(regions.regions) if stop is None else stop
    best: int | None = None
    for i in range(start, stop):
        r = regions.regions[i]
        if r.free and r.size >= item.size and (
                best is None or r.size < regions.regions[best].size):
            best = i
    return best


def place(regions: RegionList, items: Sequence[Item], movable: set[str]) -> Placement:
    """Place every item (aligned sizes, keys not yet in ``regions``); NoRoom when they
    cannot all fit even after compaction. Tensors not in ``movable`` (mapped by an
    engine, or being filled) never move; compactions done before a NoRoom stay done
    (their moves are valid, and were applied to the region list)."""
    out = Placement()
    todo = sorted(items, key=lambda t: t.size, reverse=True)
    if sum(t.size for t in todo) > regions.free_bytes():
        raise NoRoom(f"{sum(t.size for t in todo)} bytes needed, "
                     f"{regions.free_bytes()} free")
    left = _fit(regions, todo, out)
    if not left:
        return out
    # The tensors do not all fit as the regions are: Stage 2 (§3.2.2).
    _undo(regions, out)
    out.packed = True
    packing = partitioned_gain_packing(todo, regions.regions)
    out.merge_cost = packing.merge_cost
    # Subspaces as byte ranges: their edges are partition points (allocated, never moved)
    # or the arena's ends, so placing, releasing and compacting inside one keeps its range.
    spans = [(regions.regions[s.start].offset, regions.regions[s.stop - 1].end, s.items)
             for s in packing.allocations if s.stop > s.start and s.items]
    leftover: list[Item] = []
    for lo, hi, items_here in spans:
        placed = dict.fromkeys(out.offsets)
        miss = _fit(regions, items_here, out, *_span(regions, lo, hi))
        if miss:  # compact this subspace only, then fit its share again
            for t in items_here:
                if t.key in out.offsets and t.key not in placed:
                    regions.release(t.key)
                    del out.offsets[t.key]
            out.moves += regions.compact(*_span(regions, lo, hi), movable)
            out.compactions += 1
            miss = _fit(regions, items_here, out, *_span(regions, lo, hi))
        leftover += miss
    if leftover:
        leftover = _fit(regions, leftover, out)
    if leftover:  # the worst case Algorithm 1 starts from: merge every free region
        _undo(regions, out)
        out.moves += regions.compact(0, len(regions.regions), movable)
        out.compactions += 1
        leftover = _fit(regions, todo, out)
    if leftover:
        _undo(regions, out)
        raise NoRoom(f"{len(leftover)} tensors do not fit even after compaction "
                     "(tensors in use cannot move)")
    return out


def _fit(regions: RegionList, items: Sequence[Item], out: Placement, start: int = 0,
         stop: int | None = None) -> list[Item]:
    """Best fit of ``items`` (largest first) into regions[start:stop]; those that found no
    room. The range's end is tracked as placing splits regions."""
    stop = len(regions.regions) if stop is None else stop
    miss = []
    for t in sorted(items, key=lambda t: t.size, reverse=True):
        i = best_fit(regions, t, start, stop)
        if i is None:
            miss.append(t)
            continue
        before = len(regions.regions)
        out.offsets[t.key] = regions.place(i, t.key, t.size).offset
        stop += len(regions.regions) - before
    return miss


def _undo(regions: RegionList, out: Placement) -> None:
    for key in list(out.offsets):
        regions.release(key)
    out.offsets.clear()


def _span(regions: RegionList, lo: int, hi: int) -> tuple[int, int]:
    """The index range of the regions tiling bytes [lo, hi)."""
    start = next(i for i, r in enumerate(regions.regions) if r.offset == lo)
    stop = next(i for i in range(start, len(regions.regions))
                if regions.regions[i].end == hi) + 1
    return start, stop
