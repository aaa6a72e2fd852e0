"""Tangram §3.4 Algorithm 2: the node that activates a model is the one of least expected
latency, Eq. 3's load time (S - S') / B plus its queue; and the dispatcher activates an
evicted model's first request there."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.cluster import Load, ModelSpec, NodeChannels, NodeInfo, NodeRegistry
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import affinity_schedule, best_node, place_models
from services.scheduler.placement.algorithm import ModelDemand
from services.scheduler.routing import Dispatcher, DispatchSettings, RouteRequest, make_policy
from shared.model_catalog import ModelEntry
from shared.model_residency import ModelResidency

MIB = 2**20


def registry(nodes: dict[str, Load]) -> NodeRegistry:
    reg = NodeRegistry(heartbeat_timeout_s=60)
    for node, load in nodes.items():
        reg.register(NodeInfo(node, f"{node}:1", (ModelSpec("other"),)))
        reg.heartbeat(node, load)
    return reg


def holding(resident: int, bw: float = 100 * MIB, total: int = 100 * MIB,
            queue_s: float = 0.0, budget: int = 0, active: bool = False) -> Load:
    return Load(residency=(ModelResidency("m", resident, total, active),),
                load_bytes_per_s=bw, queue_delay_s=queue_s, device_budget_bytes=budget,
                blocks_free=10)


def test_equal_bandwidths_pick_the_node_holding_the_most_reusable_bytes() -> None:
    reg = registry({"a": holding(10 * MIB), "b": holding(60 * MIB), "c": holding(30 * MIB)})
    est = best_node("m", reg.healthy())
    assert est is not None and est.node.node_id == "b"
    assert est.missing_bytes == 40 * MIB and est.load_s == pytest.approx(0.4)
    assert est.reuse == "part"


def test_different_bandwidths_pick_the_faster_node() -> None:
    # Same bytes held: the faster one. And more held does not beat 4x the bandwidth.
    reg = registry({"slow": holding(50 * MIB, bw=50 * MIB),
                    "fast": holding(50 * MIB, bw=200 * MIB)})
    assert best_node("m", reg.healthy()).node.node_id == "fast"  # type: ignore[union-attr]
    reg = registry({"slow": holding(60 * MIB, bw=50 * MIB), "fast": holding(0, bw=200 * MIB)})
    est = best_node("m", reg.healthy())
    assert est is not None and est.node.node_id == "fast"  # 0.5 s against 0.8 s
    assert est.reuse == "none"


def test_the_queue_counts_and_an_active_copy_loads_nothing() -> None:
    reg = registry({"a": holding(100 * MIB, queue_s=2.0), "b": holding(0)})
    assert best_node("m", reg.healthy()).node.node_id == "b"  # type: ignore[union-attr]
    reg = registry({"a": holding(0, active=True), "b": holding(90 * MIB)})
    est = best_node("m", reg.healthy())
    assert est is not None and est.node.node_id == "a" and est.load_s == 0.0


def test_can_run_leaves_out_a_node_too_small_and_unmeasured_nodes_count_as_the_fastest(
) -> None:
    reg = registry({"small": holding(90 * MIB, budget=50 * MIB), "big": holding(0)})
    assert best_node("m", reg.healthy()).node.node_id == "big"  # type: ignore[union-attr]
    reg = registry({"small": holding(90 * MIB, budget=50 * MIB)})
    assert best_node("m", reg.healthy()) is None
    # "new" has measured nothing yet: it is assumed as fast as the fastest known.
    reg = registry({"known": holding(20 * MIB, bw=100 * MIB), "new": holding(40 * MIB, bw=0)})
    assert best_node("m", reg.healthy()).node.node_id == "new"  # type: ignore[union-attr]


def test_a_node_given_a_model_is_not_given_another_in_the_same_round() -> None:
    """Line 13: GPUs.erase(best_gpu)."""
    load = Load(residency=(ModelResidency("x", 80, 100, False),
                           ModelResidency("y", 90, 100, False)), load_bytes_per_s=10.0)
    reg = registry({"a": load, "b": Load(load_bytes_per_s=10.0)})
    out = affinity_schedule(["x", "y", "z"], reg.healthy(), lambda m: 100)
    assert [(m, e.node.node_id) for m, e in out] == [("x", "a"), ("y", "b")]


def test_algorithm_1_breaks_ties_by_load_time() -> None:
    """Two idle nodes have the same KV pressure (0): the one that loads the model sooner
    gets it."""
    demands = [ModelDemand("m", 0.0, 100, 1.0, current=None)]
    cap = {"a": 1000, "b": 1000}
    assert place_models(demands, cap, 0.0) == {"m": "a"}
    assert place_models(demands, cap, 0.0,
                        load_s=lambda m, n: 0.1 if n == "b" else 1.0) == {"m": "b"}


def test_the_dispatcher_activates_an_evicted_model_where_algorithm_2_says() -> None:
    """Wired: the route of an evicted catalogue model's first request. Prism's least KV
    pressure alone would pick "idle" (no work); "holder" holds most of the weights."""
    async def run() -> str:
        idle = Load(blocks_free=1000, load_bytes_per_s=100 * MIB)
        reg = registry({"idle": idle, "holder": holding(95 * MIB)})
        reg.get("holder").routed = 3  # type: ignore[union-attr]
        metrics = SchedulerMetrics()
        d = Dispatcher(reg, make_policy("balanced"), NodeChannels(), DispatchSettings(),
                       metrics=metrics, catalog=(ModelEntry("m", "/not/here"),))
        plan = await d.pick(RouteRequest("m", "s1", "t"))
        assert metrics.affinity_choices.labels("request", "part")._value.get() == 1
        return plan.node.node_id
    assert asyncio.run(run()) == "holder"


def test_a_node_reporting_a_model_whole_loads_nothing_whatever_its_files_weigh() -> None:
    """A Reuse Store counts distinct engine tensors (90 MiB here), the catalogue the files
    (100 MiB: headers, identical tensors held once in the store): the node's own total is
    the S its S' is measured against."""
    reg = registry({"a": holding(90 * MIB, total=90 * MIB), "b": holding(0)})
    est = best_node("m", reg.healthy(), total_bytes=100 * MIB)
    assert est is not None and est.node.node_id == "a"
    assert est.missing_bytes == 0 and est.reuse == "all"
