"""The map from a chat's leading context to the nodes holding it (issue 41): a shared
system prompt is locality for a new session; tenants never share an entry; bounded."""

from __future__ import annotations

from services.scheduler.cluster import PrefixMap, prompt_prefix
from services.scheduler.routing import RouteRequest, make_policy
from tests.unit.scheduler.advisory.test_placement import placement

SYSTEM = ("system", "You are the team's reviewer. " * 20)


def test_the_chain_covers_the_context_not_the_new_input() -> None:
    a = prompt_prefix("t", "m", "", [SYSTEM, ("user", "first question")])
    b = prompt_prefix("t", "m", "", [SYSTEM, ("user", "another question")])
    assert len(a) == 1 and a == b
    longer = prompt_prefix("t", "m", "", [SYSTEM, ("user", "q"), ("assistant", "a"),
                                          ("user", "q2")])
    assert longer[0] == a[0] and len(longer) == 3
    assert prompt_prefix("u", "m", "", [SYSTEM, ("user", "q")]) != a  # another tenant
    assert prompt_prefix("t", "m", "[tools]", [SYSTEM, ("user", "q")]) != a  # other tools
    assert prompt_prefix("t", "m", "", [("user", "only input")]) == ()


def test_holders_of_the_longest_known_prefix_most_recent_first() -> None:
    m = PrefixMap(capacity=4)
    p1 = prompt_prefix("t", "m", "", [SYSTEM, ("user", "q"), ("assistant", "a"), ("user", "b")])
    m.turn_ended("t", "s1", p1[:1], "node0")
    m.turn_ended("t", "s2", p1, "node1")
    assert m.holders(p1) == ("node1",)
    assert m.holders(p1[:1]) == ("node1", "node0")
    m.saved("t", "s1", "node2")  # a save report: node2's kvstore holds s1's prefix too
    assert m.holders(p1[:1]) == ("node2", "node1", "node0")
    m.forget_node("node2")
    assert m.holders(p1[:1]) == ("node1", "node0")
    for i in range(5):  # bounded: the least recently used entries go
        m.record((f"h{i}",), "node0")
    assert len(m) == 4 and m.holders(p1) == ()


def test_a_new_session_goes_to_the_node_holding_its_system_prompt() -> None:
    _, reg, _ = placement("balanced")
    nodes = reg.all()
    prefix = prompt_prefix("t", "m", "", [SYSTEM, ("user", "q")])
    policy = make_policy("balanced")
    route = RouteRequest("m", "new", "t", prefix=prefix)
    plain = policy.route(nodes, route)
    assert plain is not None and plain.node.node_id == "node0"  # (ties: the first)
    plan = policy.route(nodes, RouteRequest("m", "new", "t", prefix=prefix,
                                            prefix_nodes=("node1",)))
    assert plan is not None and plan.node.node_id == "node1"
    # load still comes first, and a session's own holder before a shared prefix
    reg.begin("node1")
    plan = policy.route(reg.all(), RouteRequest("m", "new", "t", prefix_nodes=("node1",)))
    assert plan is not None and plan.node.node_id == "node0"
    reg.end("node1")
    plan = policy.route(reg.all(), RouteRequest("m", "s", "t", holder="node0",
                                                prefix_nodes=("node1",)))
    assert plan is not None and plan.node.node_id == "node0"
