"""The policies: balanced (least loaded, ties to fewest routed, then least recently used;
advised requests to their advisory's node), priority (high-priority sessions spread
evenly), sticky and recompute (the baselines)."""

from __future__ import annotations

import pytest

from services.scheduler.cluster import Load, ModelSpec, NodeInfo, NodeRegistry
from services.scheduler.routing import POLICIES, RouteRequest, make_policy


def registry(*node_ids: str) -> tuple[NodeRegistry, list[float]]:
    t = [0.0]
    reg = NodeRegistry(10.0, clock=lambda: t[0])
    for n in node_ids:
        reg.register(NodeInfo(n, "addr", (ModelSpec("m"),)))
    return reg, t


def choose(reg: NodeRegistry) -> str:
    node = make_policy("balanced").choose(reg.healthy("m"), RouteRequest("m"))
    assert node is not None
    return node.node_id


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
    assert make_policy("balanced").choose([], RouteRequest("m")) is None
    with pytest.raises(ValueError, match="known policies: balanced"):
        make_policy("nope")
    assert "balanced" in POLICIES


def test_an_advised_request_goes_to_its_advisory_node_under_balanced() -> None:
    reg, _ = registry("a", "b")
    reg.heartbeat("b", Load(running=3))  # busier, but advised
    node = make_policy("balanced").choose(reg.healthy("m"), RouteRequest("m", advised="b"))
    assert node is not None and node.node_id == "b"


def test_sticky_keeps_a_session_on_its_node_and_recompute_ignores_kv() -> None:
    reg, _ = registry("a", "b")
    reg.heartbeat("a", Load(running=5))
    sticky, recompute = make_policy("sticky"), make_policy("recompute")

    def pick(policy, request: RouteRequest) -> str:
        node = policy.choose(reg.healthy("m"), request)
        assert node is not None
        return node.node_id

    held = RouteRequest("m", "s", holder="a", advised="b")
    assert pick(sticky, held) == "a"
    assert pick(sticky, RouteRequest("m", "new")) == "b"
    assert pick(recompute, held) == "b"
    reg.drain("a")  # the holder left rotation: sticky moves on
    assert pick(sticky, held) == "b"
    assert (sticky.moves_kv, sticky.prefetches, sticky.reuses_kv) == (False, False, True)
    assert (recompute.moves_kv, recompute.prefetches, recompute.reuses_kv) == (False,) * 3
    assert sorted(POLICIES) == ["balanced", "priority", "recompute", "sticky"]


def test_priority_spreads_high_priority_sessions_and_sends_them_straight_to_device() -> None:
    reg, _ = registry("a", "b", "c")
    reg.heartbeat("a", Load(running=1))  # b and c idle: balanced would pick b every time
    policy = make_policy("priority")
    assert policy.straight_to_device and not make_policy("balanced").straight_to_device
    picked = []
    for i in range(4):
        node = policy.choose(reg.healthy("m"), RouteRequest("m", f"s{i}", priority=5))
        assert node is not None
        picked.append(node.node_id)
        reg.advised_priority(node.node_id, +1)  # (what the advisor records)
    assert sorted(picked[:3]) == ["a", "b", "c"] and picked[3] in {"b", "c"}
    # a regular session is placed as balanced places it; an advised one follows its advisory
    regular = policy.choose(reg.healthy("m"), RouteRequest("m", "r"))
    assert regular is not None and regular.node_id in {"b", "c"}
    advised = policy.choose(reg.healthy("m"), RouteRequest("m", "x", priority=5, advised="a"))
    assert advised is not None and advised.node_id == "a"
