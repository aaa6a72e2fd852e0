"""MIRAGE §5.2 across a node: an idle engine lends layers' weight memory to the node's
budget (the ledger), a busy engine's KV grows into it, the idle engine's tokens stay those
of its unremapped model, and reversion restores the weights once the KV is freed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig, RemapConfig
from services.engine.engine_core import EngineCore
from services.engine.metrics import render_engine_metrics
from services.engine.model import LoadedModel, load_model, write_demo_model
from services.engine.model_slot import weight_bytes
from services.engine.wire import status_to_proto
from shared.device_ledger import DeviceLedger, create_ledger
from tests.unit.engine.remap.test_streaming import PROMPTS, add, run

PAGE = 16 << 10


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_demo_model(tmp_path_factory.mktemp("model") / "deep", size="tiny-deep")
    return load_model(path, dtype=torch.float32)


def engine(loaded: LoadedModel, ledger: DeviceLedger, budget: int) -> EngineCore:
    """An engine of the node: joins the ledger and holds its weights there (as the engine's
    model slot does for a privately loaded model)."""
    ledger.join(loaded.name)
    assert ledger.take(weight_bytes(loaded.model), weights=True)
    cfg = EngineConfig(dtype="float32", device_memory_bytes=budget, page_bytes=PAGE,
                       debug_checks=True, remap=RemapConfig(enabled=True, capped=False,
                                                            max_fraction=0.75))
    return EngineCore(cfg, loaded, ledger=ledger)


def greedy(core: EngineCore, loaded: LoadedModel) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        add(core, loaded, f"r{i}", p)
    return run(core)


def test_an_idle_engine_lends_layers_to_the_node_and_takes_them_back(
        deep: LoadedModel, tmp_path: Path) -> None:
    weights = weight_bytes(deep.model)
    node = create_ledger(tmp_path / "ledger", 2 * weights + 24 * PAGE)
    la, lb = DeviceLedger(node), DeviceLedger(node)
    busy, idle = engine(deep, la, 64 * PAGE), engine(deep, lb, 64 * PAGE)
    try:
        assert idle.remap is not None and busy.remap is not None
        alone = greedy(idle, deep)  # the idle engine's tokens before it lends anything
        step = idle.remap.target.layer_bytes
        free, held, kv = la.free_bytes(), lb.mine().weight_bytes, lb.mine().kv_bytes
        room = busy.pool.num_uncommitted_blocks

        assert idle.remap.lend_to_node(2) == 2
        # exactly two layers' bytes leave its weights for the node's budget (the ledger)
        assert lb.mine().weight_bytes == held - 2 * step
        assert la.free_bytes() == free + 2 * step
        assert la.lent_bytes() == 2 * step  # the node's ledger shows them lent
        span, per_page = busy.pool.page_span, busy.pool.blocks_per_page
        assert room == free // span * per_page  # (the node's budget binds, not the pool)
        # the busy engine's KV may take them
        assert busy.pool.num_uncommitted_blocks == (free + 2 * step) // span * per_page
        st = status_to_proto(idle.status()).remap  # what the node's broker sees
        assert (st.alpha, st.node_layers, st.node_lent_bytes) == (2, 2, 2 * step)
        assert st.give_way == "prefetched_kv,idle_weights,active_weights"
        text = render_engine_metrics(idle.status()).decode()
        assert re.search(r"^overture_engine_remap_node_layers\{.*\} 2\.0$", text, re.M), text
        # the lending engine computes its streamed layers in slots: the same tokens
        assert idle.remap.streamer.plan.alpha == 2
        assert greedy(idle, deep) == alone

        # the busy engine's KV takes every free byte, lent ones too: no reversion yet
        pages = []
        while (page := busy.pool.grow()) is not None:
            pages.append(page)
        assert la.free_bytes() < step
        assert idle.remap.lend_to_node(-2) == 2
        assert lb.mine().weight_bytes == held - 2 * step
        for page in pages:  # the burst is over: its KV is freed
            busy.pool.release(page)
        assert idle.remap.lend_to_node(-2) == 0  # reversion: the weights' bytes are back
        assert lb.mine().weight_bytes == held and la.lent_bytes() == 0
        assert la.free_bytes() == free - (lb.mine().kv_bytes - kv)  # (its own KV grew)
        assert idle.remap.streamer.plan.alpha == 0
    finally:
        busy.close()
        idle.close()
        la.close()
        lb.close()


def test_a_busy_engine_grows_past_its_own_budget_into_lent_bytes(
        deep: LoadedModel, tmp_path: Path) -> None:
    """Prism's set-up: each engine's pool is its share of the node; the node's budget has
    room, the busy pool does not. Lent bytes raise every pool's page limit."""
    node = create_ledger(tmp_path / "ledger", 2 * weight_bytes(deep.model) + 64 * PAGE)
    la, lb = DeviceLedger(node), DeviceLedger(node)
    busy, idle = engine(deep, la, 8 * PAGE), engine(deep, lb, 8 * PAGE)
    try:
        assert idle.remap is not None
        step, span = idle.remap.target.layer_bytes, busy.pool.page_span
        grown = list(iter(busy.pool.grow, None))
        assert len(grown) == 8  # its own budget
        assert idle.remap.lend_to_node(2) == 2
        grown += list(iter(busy.pool.grow, None))
        assert len(grown) == (8 * PAGE + 2 * step) // span  # two layers' bytes more
        assert idle.remap.lend_to_node(-2) == 0  # (the node has the bytes: reversion)
        assert la.lent_bytes() == 0 and busy.pool.num_uncommitted_blocks == 0
        assert la.used_bytes() <= la.budget_bytes
    finally:
        busy.close()
        idle.close()
        la.close()
        lb.close()


def test_an_engine_lends_no_more_than_its_cap_nor_weights_it_does_not_hold(
        deep: LoadedModel, tmp_path: Path) -> None:
    node = create_ledger(tmp_path / "ledger", 2 * weight_bytes(deep.model) + 24 * PAGE)
    ledger = DeviceLedger(node)
    core = engine(deep, ledger, 16 * PAGE)
    try:
        assert core.remap is not None
        assert core.remap.lend_to_node(10) == 3  # max_fraction 0.75 of 4 layers
        assert core.remap.lendable_layers() == 0
        assert core.remap.lend_to_node(-10) == 0
        ledger.give(ledger.mine().weight_bytes, weights=True)  # (a Reuse Store's weights)
        assert core.remap.lend_to_node(1) == 0  # not its bytes to lend
    finally:
        core.close()
        ledger.close()
