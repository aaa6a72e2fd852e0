"""Weights and KV in one node budget (Tangram §3.3): resident tensors count in the device
ledger; KV pages that need the memory get it back from inactive models' tensors, cheapest
first, through the memory broker; a weight load the budget cannot hold fails as NoRoom."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.nodemgr.memory_broker import EngineMemory, MemoryBroker
from services.nodemgr.reuse_store import ModelIndex, NoRoom, ReuseStore, ShmArena
from services.nodemgr.reuse_store.fingerprint import TensorSpec
from shared.device_ledger import DeviceLedger, create_ledger

MIB = 1 << 20


def index(model: str, *tensors: tuple[str, int]) -> ModelIndex:
    return ModelIndex(model, "", "float32",
                      tuple(TensorSpec(f"t{i}", k, n) for i, (k, n) in enumerate(tensors)), ())


@pytest.fixture
def ledgers(tmp_path: Path) -> Iterator[tuple[DeviceLedger, DeviceLedger]]:
    path = create_ledger(tmp_path / "ledger", 8 * MIB)
    weights, engine = DeviceLedger(path), DeviceLedger(path)
    weights.join("reuse-store")
    engine.join("some-model")
    yield weights, engine
    weights.close()
    engine.close()


def test_kv_takes_inactive_weights_back(ledgers: tuple[DeviceLedger, DeviceLedger],
                                        tmp_path: Path) -> None:
    weights, engine = ledgers
    arena = ShmArena(8 * MIB, str(tmp_path))
    try:
        store = ReuseStore(arena, weights, dtype="float32")
        store.add_index(index("a", ("x", 3 * MIB), ("y", 2 * MIB)))
        store.add_index(index("b", ("z", 1 * MIB)))
        for m in ("a", "b"):
            store.plan(m)
            store.committed(m, 0.1)
        assert weights.mine().weight_bytes == 6 * MIB
        assert not engine.take(4 * MIB)  # the budget is the weights' now
        store.deactivated("a")  # a is idle: its tensors may give way, b's may not
        broker = MemoryBroker(
            poll=lambda: _engines([EngineMemory("e", running=1, waiting=2,
                                                committed_blocks=0)]),
            shrink=_nothing, release_weights=lambda: store.release(4 * MIB))
        assert asyncio.run(broker.balance()) == 0  # (no idle engine had pages)
        assert broker.released_weight_bytes == 5 * MIB  # both of a's tensors (3 + 2)
        assert store.regions.find("z") is not None and store.regions.find("x") is None
        assert engine.take(4 * MIB)
        store.check_integrity()
        # Now KV holds the budget: a's weights cannot come back until it is given.
        with pytest.raises(NoRoom):
            store.plan("a")
        engine.give(4 * MIB)
        store.plan("a")
        store.check_integrity()
    finally:
        arena.close()


async def _engines(e: list[EngineMemory]) -> list[EngineMemory]:
    return e


async def _nothing(name: str, pages: int) -> int:
    return 0
