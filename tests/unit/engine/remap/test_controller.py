"""MIRAGE Algorithm 1 (§5.5) with a fake allocator, and its lending on a real KV pool:
lent layers' bytes become KV pages exactly, reversion gives them back; §5.2's order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.device_memory import DeviceMemory
from services.engine.remap import PoolLender, RemappingController, RemapTarget
from shared.device_ledger import DeviceLedger, create_ledger

LAYER = 10_000  # bytes of one fake layer


class FakeAllocator:
    """Running out while ``short``; lent units empty again once ``in_use`` is 0."""

    def __init__(self) -> None:
        self.short = False
        self.in_use = 0
        self.lent: list[int] = []

    def running_out(self) -> bool:
        return self.short

    def lend(self, nbytes: int) -> None:
        self.lent.append(nbytes)

    def reclaim(self, nbytes: int) -> bool:
        if self.in_use:
            return False
        self.lent.remove(nbytes)
        return True


def target(name: str, **kw: object) -> RemapTarget:
    base: dict[str, object] = {"num_layers": 8, "layer_bytes": LAYER, "cap": 4}
    base.update(kw)
    return RemapTarget(name, **base)  # type: ignore[arg-type]


def test_a_burst_triggers_remapping_and_it_reverts_after_the_burst() -> None:
    fake = FakeAllocator()
    c = RemappingController(fake)
    c.add(target("m", cap=3))
    assert c.step().alpha == {"m": 0} and not c.enabled  # no pressure: nothing lent
    fake.short, fake.in_use = True, 5
    for want in (1, 2, 3, 3):  # one layer per step (Algorithm 1 line 4), up to the cap
        st = c.step()
        assert st.alpha["m"] == want and st.enabled
    assert fake.lent == [LAYER] * 3 and c.lent_bytes == 3 * LAYER
    fake.short = False  # the burst's demand is met, its KV still in use: nothing back
    assert c.step().alpha["m"] == 3 and c.enabled
    fake.in_use = 0  # the burst is over, the added KV empty: every layer comes back
    st = c.step()
    assert st.alpha["m"] == 0 and not st.enabled
    assert fake.lent == [] and c.lent_bytes == 0 and (c.remaps, c.reversions) == (3, 3)


def test_inactive_models_give_layers_before_the_active_one_pinned_last() -> None:
    fake = FakeAllocator()
    fake.short = True
    c = RemappingController(fake)
    c.add(target("active", active=True, cap=2))
    c.add(target("idle-important", active=False, priority=5, cap=1))
    c.add(target("idle-low", active=False, priority=0, cap=2))
    c.add(target("pinned", active=False, pinned=True, cap=1))
    order = []
    for _ in range(7):
        before = c.state().alpha
        after = c.step().alpha
        order += [n for n in after if after[n] != before[n]]
    assert order == ["idle-low", "idle-low", "idle-important", "active", "active", "pinned"]
    assert c.step().alpha == {"active": 2, "idle-important": 1, "idle-low": 2, "pinned": 1}


def test_equal_priority_remaps_the_most_recently_activated_first() -> None:
    fake = FakeAllocator()
    fake.short = True
    c = RemappingController(fake)
    c.add(target("older", active=False, activated_at=1.0, cap=1))
    c.add(target("newer", active=False, activated_at=2.0, cap=1))
    assert c.step().alpha == {"older": 0, "newer": 1}


def test_reversion_gives_back_the_newest_unit_first() -> None:
    fake = FakeAllocator()
    fake.short = True
    c = RemappingController(fake)
    c.add(target("a", active=False, cap=1))
    c.add(target("b", active=True, cap=1))
    c.step(), c.step()
    assert c.state().alpha == {"a": 1, "b": 1}
    fake.short = False
    calls: list[int] = []

    def reclaim_one(nbytes: int) -> bool:  # only one unit's KV is empty
        calls.append(nbytes)
        return len(calls) == 1

    fake.reclaim = reclaim_one  # type: ignore[method-assign]
    assert c.step().alpha == {"a": 1, "b": 0}  # b lent last, so b's comes back first


# ---- a real pool -----------------------------------------------------------------------

BLOCK = 1024  # 2 * 4 tokens * 1 head * 32 dims * 4 bytes
PAGE = 4 * BLOCK


def pool(budget_pages: int, lendable: int, ledger: DeviceLedger | None = None) -> DeviceMemory:
    return DeviceMemory(block_size=4, num_kv_heads=1, head_dim=32, dtype=torch.float32,
                        budget_bytes=budget_pages * PAGE, page_bytes=PAGE,
                        lendable_bytes=lendable, ledger=ledger)


def test_remapping_returns_exactly_the_layers_bytes_to_the_kv_budget() -> None:
    layer = 3 * PAGE  # one layer's weights: three KV pages
    p = pool(2, lendable=2 * layer)
    blocks = BlockAllocator(p)
    need = [0]
    lender = PoolLender(p, blocks, lambda: need[0], lambda: 0)
    c = RemappingController(lender)
    c.add(RemapTarget("m", 8, layer, cap=2))
    try:
        held = blocks.allocate(8)  # the budget's 2 pages, full
        assert held is not None and blocks.num_available() == 0
        need[0] = 12
        c.step()  # one layer lent: exactly its bytes, three more pages
        assert p.kv_budget_bytes == 2 * PAGE + layer and p.page_limit == 5
        assert blocks.num_available() == 12
        more = blocks.allocate(12)
        assert more is not None
        c.step()  # still short: a second layer
        assert p.kv_budget_bytes == 2 * PAGE + 2 * layer and blocks.num_available() == 12
        blocks.check_integrity()
        need[0] = 0
        c.step()  # its pages are empty (the newest), the first layer's are not
        assert c.state().alpha == {"m": 1} and p.kv_budget_bytes == 2 * PAGE + layer
        blocks.free(more)
        c.step()  # reversion: the budget is the weights' again, the pages released
        assert c.state().alpha == {"m": 0} and not c.enabled
        assert p.kv_budget_bytes == 2 * PAGE and p.page_limit == 2
        assert p.num_committed_pages == 2 and blocks.num_available() == 0
        blocks.check_integrity()
        blocks.free(held)
    finally:
        p.close()


def test_on_a_node_ledger_lent_bytes_move_from_weights_to_kv_and_back(tmp_path: Path) -> None:
    layer = 3 * PAGE
    path = create_ledger(tmp_path / "ledger", 4 * PAGE + 2 * layer)
    ledger = DeviceLedger(path)
    ledger.join("m")
    try:
        assert ledger.take(2 * layer, weights=True)  # the model's weights (two layers' worth)
        p = pool(4, lendable=2 * layer, ledger=ledger)
        blocks = BlockAllocator(p)
        need = [0]
        c = RemappingController(PoolLender(p, blocks, lambda: need[0], lambda: 0))
        c.add(RemapTarget("m", 8, layer, cap=2))
        held = blocks.allocate(16)
        assert held is not None and blocks.num_available() == 0
        need[0] = 4
        c.step()
        assert ledger.mine().weight_bytes == layer  # exactly one layer's bytes handed over
        more = blocks.allocate(12)
        assert more is not None and ledger.mine().kv_bytes == 4 * PAGE + layer
        blocks.free(more)
        need[0] = 0
        c.step()
        assert ledger.mine().weight_bytes == 2 * layer  # restored
        assert ledger.mine().kv_bytes == 4 * PAGE
        blocks.free(held)
        p.close()
    finally:
        ledger.close()


@pytest.mark.parametrize("cached", [False, True])
def test_lent_pages_holding_live_kv_are_not_taken_back(cached: bool) -> None:
    layer = PAGE
    p = pool(1, lendable=layer)
    blocks = BlockAllocator(p)
    try:
        p.lend(layer)
        got = blocks.allocate(8)
        assert got is not None
        top = got[4:]  # the lent page's blocks
        assert not blocks.release_from(1) and not p.take_back(layer)
        if cached:  # cached KV with no reference is empty: it goes with the page
            for i, b in enumerate(top):
                blocks.cache(b, (b"h", i))
        blocks.free(top)
        assert blocks.release_from(1) and p.take_back(layer)
        assert p.page_limit == 1 and blocks.cached_block((b"h", 0)) is None
        blocks.check_integrity()
        blocks.free(got[:4])
    finally:
        p.close()


def test_on_a_node_ledger_the_engine_lends_only_once_kv_stays_short(tmp_path: Path) -> None:
    """Idle models give way first: the broker gets ``grace_s`` to take back idle engines'
    pages and inactive weights before this engine lends a layer of its own."""
    path = create_ledger(tmp_path / "ledger", 8 * PAGE)
    ledger = DeviceLedger(path)
    ledger.join("m")
    now = [0.0]
    try:
        p = pool(2, lendable=PAGE, ledger=ledger)
        blocks = BlockAllocator(p)
        need = [blocks.num_available() + 4]
        lender = PoolLender(p, blocks, lambda: need[0], lambda: 0, grace_s=0.3,
                            clock=lambda: now[0])
        assert not lender.running_out()  # short since now: the broker's turn first
        now[0] = 0.2
        assert not lender.running_out()
        now[0] = 0.31
        assert lender.running_out()
        need[0] = 0  # the broker freed enough meanwhile: the wait starts again next time
        assert not lender.running_out()
        need[0] = blocks.num_available() + 4
        assert not lender.running_out()
        own = pool(2, lendable=PAGE)
        alone = PoolLender(own, blocks, lambda: need[0], lambda: 0, grace_s=0.3,
                           clock=lambda: now[0])
        assert alone.running_out()  # no node budget: nobody else to give way
        own.close()
        p.close()
    finally:
        ledger.close()


def test_layers_past_a_lowered_cap_go_back_once_empty() -> None:
    fake = FakeAllocator()
    fake.short, fake.in_use = True, 1
    c = RemappingController(fake)
    c.add(target("m", cap=3))
    for _ in range(3):
        c.step()
    c.target("m").cap = 1  # measured: copies of more than one layer would stall compute
    assert c.step().alpha["m"] == 3  # still short, their KV in use: kept
    fake.in_use = 0
    assert c.step().alpha["m"] == 1 and c.enabled  # still short: down to the cap only
