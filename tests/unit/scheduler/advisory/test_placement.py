"""Advisory placement carries out the policy's advisory plan: the node, the source of the
session's KV (a live holder elsewhere), and whether the advisory counts on its node until
it ends (only one whose node prefetches: a baseline's is only recorded)."""

from __future__ import annotations

import pytest

from services.scheduler.advisory import AdvisoryBook, AdvisoryPlacement
from services.scheduler.cluster import Load, ModelSpec, NodeInfo, NodeRegistry, SessionDirectory
from services.scheduler.routing import make_policy
from tests.unit.scheduler.conftest import Clock


def placement(policy: str, catalog: frozenset[str] = frozenset()
              ) -> tuple[AdvisoryPlacement, NodeRegistry, Clock]:
    clock = Clock()
    reg = NodeRegistry(3.0, clock=clock)
    for n in ("node0", "node1"):
        reg.register(NodeInfo(n, n, (ModelSpec("m"),), kvstore_address=f"{n}:7000"))
    sessions = SessionDirectory(100, 3600.0, clock)
    book = AdvisoryBook(30.0, 100, clock=clock)
    return AdvisoryPlacement(book, reg, make_policy(policy), sessions, catalog), reg, clock


def advised(reg: NodeRegistry) -> dict[str, tuple[int, int]]:
    return {n.node_id: (n.advised, n.advised_priority) for n in reg.all()}


@pytest.mark.parametrize("policy", ["balanced", "priority"])
def test_a_prefetching_advisory_counts_on_its_node_and_names_the_live_holder(
        policy: str) -> None:
    p, reg, clock = placement(policy)
    p.sessions.turn_served("t", "s", "node0", 80)
    reg.heartbeat("node0", Load(running=3))  # busier: the advisory goes to node1
    placed = p.place("t", "s", "m", priority=2)
    assert placed is not None and placed.node.node_id == "node1"
    assert placed.plan.prefetch and placed.plan.pull_from == "node0"
    assert placed.source is not None and placed.source.node_id == "node0"
    assert placed.kv_tokens == 80 and placed.advisory.prefetch
    assert placed.plan.straight_to_device == (policy == "priority")
    assert advised(reg) == {"node0": (0, 0), "node1": (1, 1)}
    assert p.follow("t", "s")[0] is placed.advisory
    assert advised(reg) == {"node0": (0, 0), "node1": (0, 0)}
    # a holder silent for longer than the slack is not named: the node looks elsewhere
    p.sessions.turn_served("t", "s2", "node0", 80)
    clock.now += 3.0 * 4
    reg.heartbeat("node1", Load())
    placed = p.place("t", "s2", "m")
    assert placed is not None and placed.node.node_id == "node1"
    assert placed.plan.pull_from == "node0" and placed.source is None


@pytest.mark.parametrize("policy", ["sticky", "recompute"])
def test_a_baselines_advisory_is_only_recorded(policy: str) -> None:
    p, reg, _ = placement(policy)
    p.sessions.turn_served("t", "s", "node0", 80)
    placed = p.place("t", "s", "m", priority=2)
    assert placed is not None and not placed.plan.prefetch and not placed.advisory.prefetch
    assert placed.plan.pull_from == "" and placed.source is None
    assert advised(reg) == {"node0": (0, 0), "node1": (0, 0)}
    assert p.invalidate("t", placed.advisory.advisory_id) is placed.advisory
    assert advised(reg) == {"node0": (0, 0), "node1": (0, 0)}


def test_a_catalogue_model_running_nowhere_is_advised_to_the_least_pressed_node() -> None:
    p, reg, _ = placement("balanced", catalog=frozenset({"other"}))
    reg.heartbeat("node0", Load(blocks_free=10))
    reg.heartbeat("node1", Load(blocks_free=100))
    placed = p.place("t", "s", "other")
    assert placed is not None and placed.node.node_id == "node1" and placed.plan.prefetch
    assert p.place("t", "s", "unknown") is None
