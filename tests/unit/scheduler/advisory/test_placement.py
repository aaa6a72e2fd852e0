"""Advisory placement carries out the policy's advisory plan: the node, the source of the
session's KV (a live holder elsewhere), and whether the advisory counts on its node until
it ends (only one whose node prefetches: a baseline's is only recorded)."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.advisory import AdvisoryBook, AdvisoryPlacement
from services.scheduler.cluster import (
    InFlight,
    Load,
    ModelSpec,
    NodeChannels,
    NodeInfo,
    NodeRegistry,
    SessionDirectory,
)
from services.scheduler.placement import ActivationQueue
from services.scheduler.routing import Dispatcher, DispatchSettings, RouteRequest, make_policy
from shared.model_catalog import ModelEntry
from shared.model_residency import ModelResidency
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


def test_an_advisory_warms_a_model_running_nowhere_where_it_loads_soonest() -> None:
    """Tangram Algorithm 2: node0 is more pressed but holds most of the model's weights;
    the advisory (which activates the model there) goes to node0, with its estimate."""
    p, reg, _ = placement("balanced", catalog=frozenset({"other"}))
    held = (ModelResidency("other", 90 << 20, 100 << 20, False),)
    reg.heartbeat("node0", Load(blocks_free=10, residency=held, load_bytes_per_s=1e8))
    reg.heartbeat("node1", Load(blocks_free=100, load_bytes_per_s=1e8))
    placed = p.place("t", "s", "other")
    assert placed is not None and placed.node.node_id == "node0" and placed.plan.prefetch
    assert placed.warm is not None and placed.warm.missing_bytes == 10 << 20
    assert placed.warm.reuse == "part"
    # A model that runs somewhere warms nothing.
    assert p.place("t", "s2", "m").warm is None  # type: ignore[union-attr]


def test_a_successor_goes_to_the_holder_when_its_predecessor_ends_first() -> None:
    """Issue 41: the predecessor running on the holder will have ended when the advised
    successor arrives, so it does not count: the successor goes to the holder (its KV is
    there). A predecessor expected to outlast the arrival still counts."""
    clock = Clock()
    reg = NodeRegistry(3.0, clock=clock)
    for n in ("node0", "node1"):
        reg.register(NodeInfo(n, n, (ModelSpec("m"),), kvstore_address=f"{n}:7000"))
    sessions = SessionDirectory(100, 3600.0, clock)
    inflight = InFlight(default_tpot_s=0.05, clock=clock)
    p = AdvisoryPlacement(AdvisoryBook(30.0, 100, clock=clock), reg, make_policy("balanced"),
                          sessions, inflight=inflight)
    sessions.turn_served("t", "succ", "node0", 400)
    # the predecessor: 40 tokens left at 50 ms each on node0 = 2 s
    ticket = inflight.begin("node0", max_tokens=50)
    inflight.progress(ticket, 10)
    reg.begin("node0")
    reg.heartbeat("node0", Load(running=1))
    placed = p.place("t", "succ", "m", expected_arrival_s=5.0)
    assert placed is not None and placed.node.node_id == "node0"
    assert placed.plan.pull_from == ""  # the KV is there already
    # arriving before the predecessor ends: node0 is busier then, node1 takes it
    placed = p.place("t", "succ", "m", expected_arrival_s=1.0)
    assert placed is not None and placed.node.node_id == "node1"
    assert placed.plan.pull_from == "node0"
    # the predecessor ended, but node0's last beat still counts it as running
    clock.now += 0.5
    p.follow("t", "succ")
    inflight.end(ticket)
    reg.end("node0")
    placed = p.place("t", "succ", "m")
    assert placed is not None and placed.node.node_id == "node0"


def test_tpot_is_measured_from_the_gaps_between_chunks() -> None:
    clock = Clock()
    inflight = InFlight(default_tpot_s=1.0, weight=1.0, clock=clock)
    t = inflight.begin("n", max_tokens=100)
    inflight.progress(t, 1)  # the first token: prefill, no sample
    assert inflight.tpot("n") == 1.0
    clock.now += 0.2
    inflight.progress(t, 4)  # 4 tokens in 0.2 s
    assert inflight.tpot("n") == pytest.approx(0.05)
    assert inflight.remaining_s(t) == pytest.approx(95 * 0.05)
    assert inflight.finishing(5.0) == {"n": 1} and inflight.finishing(4.0) == {}
    unbounded = inflight.begin("n", max_tokens=0)  # up to the context: never soon
    assert inflight.finishing(3600.0) == {"n": 1}
    inflight.end(t)
    inflight.end(unbounded)
    assert len(inflight) == 0 and inflight.ended_since("n", clock.now - 1) == 2


def test_an_advisory_for_an_evicted_model_joins_the_requests_activation_queue() -> None:
    """Tangram §3.4, Algorithm 2 over one queue: node0 holds most of x's and y's bytes, so
    alone each would activate there. The advisory for x takes node0 in the queue the
    dispatcher's requests join; the request for y that comes while x activates then goes
    to node1 (a single best-node pick would have sent both to node0), and x's request
    joins x's activation on node0."""
    clock = Clock()
    reg = NodeRegistry(3.0, clock=clock)
    held = (ModelResidency("x", 80, 100, False), ModelResidency("y", 90, 100, False))
    for n, load in (("node0", Load(residency=held, load_bytes_per_s=10.0, blocks_free=10)),
                    ("node1", Load(load_bytes_per_s=10.0, blocks_free=10))):
        reg.register(NodeInfo(n, n, (ModelSpec("m"),), kvstore_address=f"{n}:7000"))
        reg.heartbeat(n, load)
    queue = ActivationQueue(clock=clock)
    p = AdvisoryPlacement(AdvisoryBook(30.0, 100, clock=clock), reg, make_policy("balanced"),
                          SessionDirectory(100, 3600.0, clock), frozenset({"x", "y"}),
                          activations=queue, model_bytes=lambda _: 100)
    placed = p.place("t", "sx", "x")
    assert placed is not None and placed.warm is not None
    assert placed.node.node_id == "node0" and placed.warm.missing_bytes == 20
    assert queue.activating() == {"x": "node0"}

    async def requests() -> list[str]:
        d = Dispatcher(reg, make_policy("balanced"), NodeChannels(), DispatchSettings(),
                       catalog=(ModelEntry("x", "/not/here"), ModelEntry("y", "/not/here")),
                       activations=queue)
        return [(await d.pick(RouteRequest(m, f"s{m}", "t"))).node.node_id for m in "yx"]

    assert asyncio.run(requests()) == ["node1", "node0"]
    assert queue.activating() == {"x": "node0", "y": "node1"}
