"""Algorithm 1 (Partitioned-Gain Packing, Tangram §3.2.2) on hand-worked examples and
against brute force on small random instances."""

from __future__ import annotations

import itertools
import random

from services.nodemgr.reuse_store.packing import (
    Item,
    capacity,
    partitioned_gain_packing,
    try_packing,
)
from services.nodemgr.reuse_store.regions import Region

U = 64  # one alignment unit


def regions(*spec: tuple[int, str | None]) -> list[Region]:
    out, at = [], 0
    for units, key in spec:
        out.append(Region(at, units * U, key))
        at += units * U
    return out


def test_try_packing_follows_lines_17_to_27() -> None:
    # Largest first into the side with more room left: 5 -> C1 (8 >= 6), 2 -> C2 (6 > 3).
    got = try_packing([Item("a", 5), Item("b", 2)], 8, 6)
    assert got == ([Item("a", 5)], [Item("b", 2)])
    # 3 after 5 is not smaller than C1's 3 left: line 21 ends it.
    assert try_packing([Item("a", 5), Item("b", 3)], 8, 6) is None
    # Line 21: a tensor not smaller than the smaller remaining capacity ends the attempt,
    # even where the larger side could hold it.
    assert try_packing([Item("a", 6)], 10, 6) is None
    assert try_packing([], 10, 10) is None  # (∅, ∅): nothing to split for


def test_figure_6_like_walk_through() -> None:
    # | free 2 | t1 (gain 1) | free 3 | t3 (gain 3) | free 3 |: M = 4, C = 12 units.
    rs = regions((2, None), (1, "t1"), (3, None), (3, "t3"), (3, None))
    items = [Item("n1", 2 * U), Item("n2", 1 * U)]
    p = partitioned_gain_packing(items, rs)
    # The gain-3 point is tried first: C1 = 6, C2 = 3 units; n1 (2) and then n2 (1) go to
    # the side with more room left, both to the left: M = 4 - 3 = 1. The left side cannot
    # split at t1 (C1 = 2: n1 is not smaller, line 21), the right one has nothing to
    # split for: the paper's Figure 6 ends the same way, "with a final merge cost of 1".
    assert p.merge_cost == 1 * U
    assert [(s.start, s.stop, [i.key for i in s.items]) for s in p.allocations] == [
        (0, 3, ["n1", "n2"]), (4, 5, [])]


def test_no_partition_point_packs_leaves_the_merge_all_cost() -> None:
    rs = regions((1, None), (4, "t1"), (1, None))
    p = partitioned_gain_packing([Item("n", 2 * U)], rs)
    assert p.merge_cost == 4 * U
    assert len(p.allocations) == 1 and p.allocations[0].items == (Item("n", 2 * U),)


def _two_bin_packs(items: list[Item], c1: int, c2: int) -> bool:
    """Brute force: some assignment of the items to two bins within their capacities."""
    for bits in itertools.product((0, 1), repeat=len(items)):
        a = sum(i.size for i, b in zip(items, bits, strict=True) if b == 0)
        if a <= c1 and sum(i.size for i in items) - a <= c2:
            return True
    return False


def test_against_brute_force_on_small_random_instances() -> None:
    rng = random.Random(7)
    for _ in range(400):
        spec = [(rng.randint(1, 4), None if rng.random() < 0.5 else f"t{i}")
                for i in range(rng.randint(2, 7))]
        rs = regions(*spec)
        free = sum(r.size for r in rs if r.free)
        items = sorted((Item(f"n{j}", rng.randint(1, 3) * U) for j in range(rng.randint(1, 4))),
                       key=lambda i: -i.size)
        if sum(i.size for i in items) > free:
            continue  # (Stage 1 runs first: the free bytes suffice in total)
        p = partitioned_gain_packing(items, rs)
        # Its search space is every allocated region as a partition point with the
        # TryPacking test: it never stops at the root where some point packs...
        points = [i for i, r in enumerate(rs) if not r.free]
        root_splits = any(try_packing(items, capacity(rs, 0, i), capacity(rs, i + 1, len(rs)))
                          for i in points)
        assert (len(p.allocations) > 1) == root_splits
        # ...what it accepts is a real two-bin packing (brute force agrees)...
        for i in points:
            got = try_packing(items, capacity(rs, 0, i), capacity(rs, i + 1, len(rs)))
            if got is not None:
                assert _two_bin_packs(items, capacity(rs, 0, i), capacity(rs, i + 1, len(rs)))
        # ...every tensor lands in exactly one subspace that can hold its share, and M is
        # the merge-all cost less the gains of the points it split at.
        placed = [i for s in p.allocations for i in s.items]
        assert sorted(placed, key=lambda i: i.key) == sorted(items, key=lambda i: i.key)
        for s in p.allocations:
            assert sum(i.size for i in s.items) <= capacity(rs, s.start, s.stop)
        cut = {i for i in points if not any(s.start <= i < s.stop for s in p.allocations)}
        assert p.merge_cost == sum(r.size for r in rs if not r.free) - sum(
            rs[i].size for i in cut)
