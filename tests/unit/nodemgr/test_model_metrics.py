"""The nodemgr's per-model and per-node memory gauges, read from a real device ledger."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from services.nodemgr.admission import DeadlineAdmission
from services.nodemgr.app import _budget, _models_state
from services.nodemgr.metrics import NodeMgrMetrics
from shared.device_ledger import DeviceLedger, create_ledger


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
                                      "device_free_bytes": 5500.0}
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
