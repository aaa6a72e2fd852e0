"""The nodemgr's per-model and per-node memory gauges, read from a real device ledger."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from services.nodemgr.admission import DeadlineAdmission
from services.nodemgr.app import _budget, _models_state
from services.nodemgr.metrics import NodeMgrMetrics
from shared.device_ledger import DeviceLedger, create_ledger
from shared.proto import engine_pb2


def test_gauges_show_each_models_bytes_reserve_and_the_nodes_free_bytes(tmp_path: Path
                                                                       ) -> None:
    path = create_ledger(tmp_path / "ledger", 10_000)
    alpha, beta = DeviceLedger(path), DeviceLedger(path)
    alpha.join("alpha")
    beta.join("beta")
    try:
        assert alpha.take(1000, weights=True) and alpha.take(3000)
        assert beta.take(500, weights=True)
        beta.reserve(2000)
        engine = SimpleNamespace(last=SimpleNamespace(models=(SimpleNamespace(name="alpha"),
                                                              SimpleNamespace(name="beta"))))
        activator = SimpleNamespace(catalog={"alpha": None, "beta": None, "gamma": None})
        state = dict(_models_state(cast(Any, engine), cast(Any, activator),
                                   DeadlineAdmission(), str(path)))
        assert state["alpha"] == {"active": 1.0, "kv_bytes": 3000.0, "weight_bytes": 1000.0,
                                  "kv_reserve_bytes": 0.0, "queued": 0.0}
        assert state["beta"]["kv_reserve_bytes"] == 2000.0 and state["beta"]["kv_bytes"] == 0
        assert state["gamma"]["active"] == 0.0  # in the catalogue, evicted
        assert _budget(str(path)) == {"device_budget_bytes": 10_000.0,
                                      "device_free_bytes": 5500.0, "device_lent_bytes": 0.0}
        metrics = NodeMgrMetrics()
        metrics.watch_models(lambda: list(state.items()))
        metrics.watch(lambda: _budget(str(path)))
        text = metrics.render().decode()
        assert 'overture_model_kv_reserve_bytes{model="beta"} 2000.0' in text
        assert 'overture_model_kv_bytes{model="alpha"} 3000.0' in text
        assert "overture_nodemgr_device_free_bytes 5500.0" in text
    finally:
        alpha.close()
        beta.close()


def test_each_models_remapping_shows_on_the_nodes_metrics(tmp_path: Path) -> None:
    """MIRAGE's metrics at the node: α, layers and bytes lent, transfer time per step and
    stalled forwards, per model, as the broker last polled its engine's Status."""
    path = create_ledger(tmp_path / "ledger", 10_000)
    engine = SimpleNamespace(last=SimpleNamespace(models=(SimpleNamespace(name="alpha"),)))
    activator = SimpleNamespace(catalog={"alpha": None, "beta": None})
    remaps = {"alpha": engine_pb2.RemapCounters(
        alpha=3, node_layers=2, lent_bytes=100, node_lent_bytes=200, step_transfer_s=0.25,
        transfer_s=4.0, stalled_forwards=7)}
    state = dict(_models_state(cast(Any, engine), cast(Any, activator), DeadlineAdmission(),
                               str(path), remaps))
    assert {k: v for k, v in state["alpha"].items() if k.startswith("remap")} == {
        "remap_alpha": 3.0, "remap_node_layers": 2.0, "remap_lent_bytes": 300.0,
        "remap_node_lent_bytes": 200.0, "remap_step_transfer_seconds": 0.25,
        "remap_transfer_seconds": 4.0, "remap_stalled_forwards": 7.0}
    assert "remap_alpha" not in state["beta"]  # remapping off (or not here)
    metrics = NodeMgrMetrics()
    metrics.watch_models(lambda: list(state.items()))
    assert 'overture_model_remap_node_lent_bytes{model="alpha"} 200.0' in \
        metrics.render().decode()
