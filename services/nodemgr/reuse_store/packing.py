"""Stage 2 of Tangram's two-stage loading heuristic: Partitioned-Gain Packing (§3.2.2,
Algorithm 1), implemented as the paper writes it.

The problem: Stage 1 freed enough bytes in total, but the free regions may be too
fragmented for the new tensors. Merging every free region into one (moving every
allocated tensor to one end) always works and costs the bytes of all allocated regions,
M. Algorithm 1 starts from that worst case and looks for *partition points*: an
allocated region t'_p whose two sides P1, P2 can each take a share of the new tensors, so
that t'_p never has to move (M shrinks by its size, the partition gain). It recurses into
both sides until no subspace splits further.

    subspace P = regions[start:stop]   capacity C = all bytes in P (free and allocated)
                                       merge cost M = allocated bytes in P
    split at allocated t'_p:  | P1 ........ | t'_p | P2 ........ |
    TryPacking (lines 17-27): the tensors, largest first, each into the side with the
    larger remaining capacity; a tensor not smaller than the smaller remaining capacity
    ends the attempt (as line 21 writes it: a stricter test than the prose's "cannot fit
    into the subspace", which never accepts a split the capacities cannot hold).

Partition points are tried largest gain first, as the paper's Figure 6 walk-through does
("it first selects the point with gain 3"); the first that packs is taken (line 12).
The tensors are sorted once and every subset keeps that order (§3.2.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.nodemgr.reuse_store.regions import Region


@dataclass(frozen=True)
class Item:
    """A new tensor to place: its key and aligned size."""

    key: str
    size: int


@dataclass(frozen=True)
class Subspace:
    """regions[start:stop] of the list Algorithm 1 ran on, and the tensors given to it."""

    start: int
    stop: int
    items: tuple[Item, ...]


@dataclass(frozen=True)
class Packing:
    """Algorithm 1's output: the allocation set A and the overall merge cost M."""

    allocations: tuple[Subspace, ...]
    merge_cost: int


def capacity(regions: Sequence[Region], start: int, stop: int) -> int:
    return sum(r.size for r in regions[start:stop])


def try_packing(items: Sequence[Item], c1: int, c2: int
                ) -> tuple[list[Item], list[Item]] | None:
    """Algorithm 1, lines 17-27: two bins of capacity c1, c2; None where the paper
    returns (∅, ∅) (which an empty ``items`` also gives: nothing to split for)."""
    t1: list[Item] = []
    t2: list[Item] = []
    for t in items:
        if t.size >= min(c1, c2):  # line 21
            return None
        if c1 >= c2:
            t1.append(t)
            c1 -= t.size
        else:
            t2.append(t)
            c2 -= t.size
    if not t1 and not t2:
        return None
    return t1, t2


def partitioned_gain_packing(items: Sequence[Item], regions: Sequence[Region]) -> Packing:
    """Algorithm 1 over the whole region list."""
    tensors = tuple(sorted(items, key=lambda t: t.size, reverse=True))  # sorted once
    pending: list[Subspace] = [Subspace(0, len(regions), tensors)]  # line 1
    done: list[Subspace] = []
    merge = sum(r.size for r in regions if not r.free)
    while pending:  # line 2
        for sub in list(pending):  # line 3
            split = _split(sub, regions)  # lines 4-12
            pending.remove(sub)
            if split is None:  # lines 13-15
                done.append(sub)
                continue
            p1, p2, gain = split
            pending += [p1, p2]  # line 10
            merge -= gain  # line 11
    return Packing(tuple(sorted(done, key=lambda s: s.start)), merge)


def _split(sub: Subspace, regions: Sequence[Region]) -> tuple[Subspace, Subspace, int] | None:
    """Lines 5-12: the first partition point (largest gain first) at which TryPacking
    succeeds, as the two halves and the gain."""
    points = [i for i in range(sub.start, sub.stop) if not regions[i].free]
    points.sort(key=lambda i: (-regions[i].size, i))
    for p in points:
        packed = try_packing(sub.items, capacity(regions, sub.start, p),
                             capacity(regions, p + 1, sub.stop))
        if packed is not None:
            t1, t2 = packed
            return (Subspace(sub.start, p, tuple(t1)), Subspace(p + 1, sub.stop, tuple(t2)),
                    regions[p].size)
    return None
