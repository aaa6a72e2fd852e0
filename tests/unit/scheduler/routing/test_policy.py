"""The policies: balanced (least loaded, ties to fewest routed, then least recently used;
advised requests to their advisory's node), priority (high-priority sessions spread
evenly), sticky and recompute (the baselines); and the plans each returns for a request
and for an advisory (what happens to the session's KV)."""

from __future__ import annotations

import pytest

from services.scheduler.cluster import Load, ModelSpec, NodeInfo, NodeRegistry
from services.scheduler.routing import (
    POLICIES,
    AdvisoryPlan,
    Policy,
    RoutePlan,
    RouteRequest,
    make_policy,
)


def registry(*node_ids: str) -> tuple[NodeRegistry, list[float]]:
    t = [0.0]
    reg = NodeRegistry(10.0, clock=lambda: t[0])
    for n in node_ids:
        reg.register(NodeInfo(n, "addr", (ModelSpec("m"),)))
    return reg, t


def pick(policy: Policy, reg: NodeRegistry, request: RouteRequest) -> str:
    plan = policy.route(reg.healthy("m"), request)
    assert plan is not None
    return plan.node.node_id


def choose(reg: NodeRegistry) -> str:
    return pick(make_policy("balanced"), reg, RouteRequest("m"))


def test_least_loaded_wins() -> None:
    reg, _ = registry("a", "b", "c")
    reg.heartbeat("a", Load(running=2))
    reg.heartbeat("b", Load(running=1, waiting=1))
    reg.heartbeat("c", Load(waiting=1))
    assert choose(reg) == "c"
    reg.begin("c")
    reg.begin("c")  # c: 1 waiting + 2 routed = 3 > a, b
    assert choose(reg) in {"a", "b"}


def test_ties_go_to_fewest_routed_then_least_recently_used() -> None:
    reg, t = registry("a", "b")
    reg.heartbeat("a", Load(running=0))
    reg.heartbeat("b", Load(running=1))
    reg.begin("a")  # both score 1; a has 1 routed, b has none
    assert choose(reg) == "b"
    reg.end("a")
    reg.heartbeat("b", Load())
    t[0] = 1.0
    reg.begin("a")
    reg.end("a")
    assert choose(reg) == "b"  # a was used more recently


def test_empty_and_unknown() -> None:
    for name in POLICIES:
        assert make_policy(name).route([], RouteRequest("m")) is None
        assert make_policy(name).advise([], RouteRequest("m")) is None
    with pytest.raises(ValueError, match="known policies: balanced"):
        make_policy("nope")
    assert "balanced" in POLICIES


def test_an_advised_request_goes_to_its_advisory_node_under_balanced() -> None:
    reg, _ = registry("a", "b")
    reg.heartbeat("b", Load(running=3))  # busier, but advised
    assert pick(make_policy("balanced"), reg, RouteRequest("m", advised="b")) == "b"


def test_a_new_sessions_blind_advisory_gives_way_to_the_node_holding_its_context() -> None:
    """The architect, advised while the product manager runs, went to the idle node; when
    it comes, the manager's node holds the team's system prompt it starts with: it goes
    there rather than recompute the prompt where the advisory staged nothing."""
    reg, _ = registry("a", "b")
    policy = make_policy("balanced")
    blind = RouteRequest("m", "architect", advised="b", prefix_nodes=("a",))
    assert pick(policy, reg, blind) == "a"
    # an advisory that chose the context's node, or one for a session with KV, is followed
    assert pick(policy, reg, RouteRequest("m", "s", advised="b", prefix_nodes=("b", "a"))) == "b"
    reg.heartbeat("b", Load(running=3))
    held = RouteRequest("m", "s", holder="b", advised="b", prefix_nodes=("a",))
    assert pick(policy, reg, held) == "b"


def test_sticky_keeps_a_session_on_its_node_and_recompute_ignores_kv() -> None:
    reg, _ = registry("a", "b")
    reg.heartbeat("a", Load(running=5))
    sticky, recompute = make_policy("sticky"), make_policy("recompute")
    held = RouteRequest("m", "s", holder="a", advised="b")
    assert pick(sticky, reg, held) == "a"
    assert pick(sticky, reg, RouteRequest("m", "new")) == "b"
    assert pick(recompute, reg, held) == "b"
    reg.drain("a")  # the holder left rotation: sticky moves on
    assert pick(sticky, reg, held) == "b"
    assert sorted(POLICIES) == ["balanced", "prefix", "priority", "recompute", "sticky"]


def test_priority_spreads_high_priority_sessions_and_sends_them_straight_to_device() -> None:
    reg, _ = registry("a", "b", "c")
    reg.heartbeat("a", Load(running=1))  # b and c idle: balanced would pick b every time
    policy = make_policy("priority")
    urgent = RouteRequest("m", "s", priority=5)
    high = policy.advise(reg.healthy("m"), urgent)
    assert high is not None and high.straight_to_device
    low = make_policy("balanced").advise(reg.healthy("m"), urgent)
    assert low is not None and not low.straight_to_device
    picked = []
    for i in range(4):
        picked.append(pick(policy, reg, RouteRequest("m", f"s{i}", priority=5)))
        reg.advised_priority(picked[-1], +1)  # (what the advisor records)
    assert sorted(picked[:3]) == ["a", "b", "c"] and picked[3] in {"b", "c"}
    # a regular session is placed as balanced places it; an advised one follows its advisory
    assert pick(policy, reg, RouteRequest("m", "r")) in {"b", "c"}
    assert pick(policy, reg, RouteRequest("m", "x", priority=5, advised="a")) == "a"


# -- the plans ---------------------------------------------------------------------------

def plans(name: str, request: RouteRequest, *node_ids: str
          ) -> tuple[RoutePlan | None, AdvisoryPlan | None]:
    """The request's and the advisory's plan of policy ``name``, among idle ``node_ids``."""
    reg, _ = registry("a", "b")
    nodes = [n for n in reg.healthy("m") if n.node_id in node_ids]
    policy = make_policy(name)
    return policy.route(nodes, request), policy.advise(nodes, request)


@pytest.mark.parametrize("name", ["balanced", "priority"])
def test_under_balanced_and_priority_the_kv_follows_the_session(name: str) -> None:
    moved = RouteRequest("m", "s", holder="a")  # its KV is on a, which is not offered
    route, advisory = plans(name, moved, "b")
    assert route is not None and advisory is not None
    assert (route.node.node_id, route.reuse_kv, route.pull_from) == ("b", True, "a")
    assert (advisory.node.node_id, advisory.prefetch, advisory.pull_from) == ("b", True, "a")
    assert not advisory.straight_to_device  # (priority 0)
    route, advisory = plans(name, moved, "a", "b")  # the holder is idle too: it wins the tie
    assert route == RoutePlan(route.node, reuse_kv=True, pull_from="") and route.node.node_id == "a"
    assert advisory == AdvisoryPlan(advisory.node, prefetch=True) and advisory.node.node_id == "a"
    route, advisory = plans(name, RouteRequest("m", "new"), "a", "b")
    assert route is not None and route.pull_from == "" and route.reuse_kv
    assert advisory is not None and advisory.pull_from == "" and advisory.prefetch


def test_priority_sends_only_high_priority_advisories_straight_to_device() -> None:
    for priority, straight in ((5, True), (0, False), (-1, False)):
        route, advisory = plans("priority", RouteRequest("m", "s", priority=priority,
                                                         holder="a"), "b")
        assert advisory == AdvisoryPlan(advisory.node, prefetch=True,
                                        straight_to_device=straight, pull_from="a")
        assert route is not None and route.reuse_kv and route.pull_from == "a"


def test_sticky_reuses_kv_where_it_is_and_moves_none() -> None:
    moved = RouteRequest("m", "s", priority=5, holder="a")
    route, advisory = plans("sticky", moved, "b")
    assert route is not None and advisory is not None
    assert (route.node.node_id, route.reuse_kv, route.pull_from) == ("b", True, "")
    assert advisory == AdvisoryPlan(advisory.node, prefetch=False)  # only recorded
    route, _ = plans("sticky", moved, "a", "b")
    assert route is not None and route.node.node_id == "a" and route.reuse_kv


def test_recompute_reuses_no_kv_at_all() -> None:
    moved = RouteRequest("m", "s", priority=5, holder="a")
    for offered in (("a",), ("b",), ("a", "b")):
        route, advisory = plans("recompute", moved, *offered)
        assert route is not None and advisory is not None
        assert (route.reuse_kv, route.pull_from) == (False, "")
        assert advisory == AdvisoryPlan(advisory.node, prefetch=False)


def test_every_policy_plans_on_the_one_node_it_is_given() -> None:
    # (a catalogue model active nowhere is activated on the node of least KV pressure,
    # chosen before the policy is asked: every policy must keep that node)
    reg, _ = registry("a", "b")
    reg.heartbeat("b", Load(running=9))
    only_b = [n for n in reg.healthy("m") if n.node_id == "b"]
    for name in POLICIES:
        for request in (RouteRequest("m", "s", priority=5, holder="a", advised="a"),
                        RouteRequest("m")):
            route = make_policy(name).route(only_b, request)
            advisory = make_policy(name).advise(only_b, request)
            assert route is not None and route.node.node_id == "b", name
            assert advisory is not None and advisory.node.node_id == "b", name


def test_a_long_session_stays_with_its_kv_until_the_load_gap_outweighs_moving_it() -> None:
    # The agent-session point of the evaluation: balanced moved a session for a node with
    # one request less and pulled its long history across; sticky kept it and won.
    reg, _ = registry("a", "b")
    reg.heartbeat("a", Load(running=2))
    reg.heartbeat("b", Load(running=0))
    policy = make_policy("balanced", move_tokens=1024)
    long_one = RouteRequest("m", "s", holder="a", holder_tokens=3000)  # margin: 2 requests
    assert pick(policy, reg, long_one) == "a"
    advice = policy.advise(reg.healthy("m"), long_one)
    assert advice is not None and advice.node.node_id == "a" and advice.pull_from == ""
    # a short history moves for the same gap; a gap beyond the margin moves the long one
    assert pick(policy, reg, RouteRequest("m", "s", holder="a", holder_tokens=900)) == "b"
    reg.heartbeat("a", Load(running=3))
    plan = policy.route(reg.healthy("m"), long_one)
    assert plan is not None and plan.node.node_id == "b" and plan.pull_from == "a"
    # move_tokens 0: load alone decides, however long the history
    assert pick(make_policy("balanced", move_tokens=0), reg,
                RouteRequest("m", "s", holder="a", holder_tokens=10**6)) == "b"
    assert pick(make_policy("priority", move_tokens=1024), reg,
                RouteRequest("m", "s", holder="a", holder_tokens=4096)) == "a"
