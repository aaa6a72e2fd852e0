"""The Tensor Allocator: placements never overlap, tensors in use never move, and the
merge-all fallback succeeds whenever the free bytes suffice and nothing is pinned."""

from __future__ import annotations

import random

import pytest

from services.nodemgr.reuse_store.allocator import NoRoom, best_fit, place
from services.nodemgr.reuse_store.packing import Item
from services.nodemgr.reuse_store.regions import ALIGN, RegionList


def fragmented(rng: random.Random) -> tuple[RegionList, list[str]]:
    rl = RegionList(ALIGN * 64)
    keys: list[str] = []
    for n in range(40):
        size = ALIGN * rng.randint(1, 6)
        i = best_fit(rl, Item("probe", size))
        if i is None:
            break
        rl.place(i, f"r{n}", size)
        keys.append(f"r{n}")
    for k in list(keys):
        if rng.random() < 0.5:
            rl.release(k)
            keys.remove(k)
    rl.check_integrity()
    return rl, keys


def test_packing_then_compaction_on_random_fragmentation() -> None:
    rng = random.Random(3)
    packed = compacted = 0
    for _ in range(500):
        rl, keys = fragmented(rng)
        pinned = {k for k in keys if rng.random() < 0.2}
        before = {k: rl.find(k).offset for k in keys}  # type: ignore[union-attr]
        items = [Item(f"n{j}", ALIGN * rng.randint(1, 8)) for j in range(rng.randint(1, 5))]
        enough = sum(i.size for i in items) <= rl.free_bytes()
        try:
            p = place(rl, items, set(keys) - pinned)
        except NoRoom:
            rl.check_integrity()
            assert pinned or not enough
            continue
        rl.check_integrity()
        packed += p.packed
        compacted += bool(p.compactions)
        for i in items:
            r = rl.find(i.key)
            assert r is not None and r.size == i.size and p.offsets[i.key] == r.offset
        for k in pinned:
            assert rl.find(k).offset == before[k]  # type: ignore[union-attr]
        for m in p.moves:
            assert m.dst < m.src and m.key not in pinned
    assert packed and compacted  # (both paths ran)


def test_fits_without_moving_when_a_free_region_holds_it() -> None:
    rl = RegionList(ALIGN * 8)
    rl.place(0, "a", ALIGN * 2)
    p = place(rl, [Item("b", ALIGN * 3)], {"a"})
    assert p.offsets == {"b": ALIGN * 2} and not p.moves and not p.packed


def test_no_room_when_the_free_bytes_do_not_suffice() -> None:
    rl = RegionList(ALIGN * 4)
    rl.place(0, "a", ALIGN * 3)
    with pytest.raises(NoRoom):
        place(rl, [Item("b", ALIGN * 2)], {"a"})
    rl.check_integrity()
