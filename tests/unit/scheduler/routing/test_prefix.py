"""Prompt prefixes as locality, through the one index of which nodes hold which prefixes
(``cluster/prefixes.py``) and its two callers:

- the ``prefix`` baseline (precise prefix-aware routing, as llm-d does it): the node whose
  device holds the longest leading run of the prompt's block hashes wins, the least loaded
  when none holds any; its plans keep KV in device memory only (chained hashes, a gap ends
  a match, least recently served blocks go first);
- a new session's locality (issue 41): a shared system prompt draws a new session to the
  nodes holding it; tenants never share an entry; bounded."""

from __future__ import annotations

from contextlib import AsyncExitStack

from services.scheduler.app import build_state
from services.scheduler.cluster import (
    BLOCK_CHARS,
    Load,
    NodeChannels,
    NodeRegistry,
    PrefixIndex,
    SessionDirectory,
    block_hashes,
    prompt_prefix,
    prompt_text,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.grpc_service import SchedulerServicer
from services.scheduler.routing import RouteRequest, make_policy
from shared.config import load
from shared.proto import scheduler_pb2
from tests.unit.scheduler.advisory.test_placement import placement
from tests.unit.scheduler.conftest import make_cluster
from tests.unit.scheduler.routing.test_kv_follows import call, serve_only
from tests.unit.scheduler.routing.test_policy import pick, registry

SYSTEM = ("system", "You are the team's reviewer. " * 20)


def test_routes_to_the_node_holding_the_longest_prefix() -> None:
    reg, _ = registry("a", "b", "c")
    reg.heartbeat("a", Load(running=0))
    reg.heartbeat("b", Load(running=5))  # the busiest holds the longest prefix
    reg.heartbeat("c", Load(running=3))
    policy = make_policy("prefix")
    req = RouteRequest("m", "s", prefix_hits=(("b", 7), ("c", 3)))
    assert pick(policy, reg, req) == "b"
    plan = policy.route(reg.healthy("m"), req)
    assert plan is not None and plan.device_only and plan.reuse_kv and plan.pull_from == ""
    # two nodes hold the same longest prefix: the less loaded of them
    assert pick(policy, reg, RouteRequest("m", prefix_hits=(("b", 4), ("c", 4)))) == "c"
    advice = policy.advise(reg.healthy("m"), req)
    assert advice is not None and not advice.prefetch  # advisories only recorded


def test_falls_back_to_least_loaded_when_no_node_holds_a_prefix() -> None:
    reg, _ = registry("a", "b", "c")
    reg.heartbeat("a", Load(running=4))
    reg.heartbeat("b", Load(running=1))
    reg.heartbeat("c", Load(running=2))
    policy = make_policy("prefix")
    assert pick(policy, reg, RouteRequest("m", "s")) == "b"
    # a holder that left rotation counts for nothing: the least loaded of those serving
    assert pick(policy, reg, RouteRequest("m", prefix_hits=(("gone", 9),))) == "b"


def test_the_index_matches_leading_blocks_and_forgets_the_least_recently_served() -> None:
    text = "x" * (BLOCK_CHARS * 4 + 10)  # four full blocks; the partial fifth is not cached
    hashes = block_hashes(text, "m")
    assert len(hashes) == 4
    assert block_hashes(text, "other model") != hashes  # the seed separates models
    index = PrefixIndex(capacity=6)
    index.served("a", hashes[:3])
    index.served("b", hashes)
    assert index.matches(["a", "b", "c"], hashes) == {"a": 3, "b": 4}
    index.evicted("b", hashes[1:2])  # a gap: block 2 is worthless without block 1
    assert index.match("b", hashes) == 1
    # capacity 6: four new blocks on a push out its three least recently served
    other = block_hashes("y" * BLOCK_CHARS * 4, "m")
    index.served("a", other)
    assert index.size("a") == 6 and index.match("a", hashes) == 0
    assert index.match("a", other) == 4
    # a rendering whose role cannot run into its content
    assert prompt_text([("user", "a"), ("assistant", "b")]) != prompt_text([("user", "ab")])


async def test_a_conversation_returns_to_the_node_holding_its_prefix() -> None:
    long_history = "abcdefghij" * 20  # several blocks (the fake engine counts words)
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, nodes=2, policy="prefix")
        await serve_only(c, "node1")
        first = [{"role": "user", "content": long_history}]
        status, _, headers = await call(c, "POST", "/v1/chat/completions",
                                        {"model": "demo", "messages": first, "max_tokens": 3},
                                        {"X-Session-Id": "s1"})
        assert status == 200 and headers["X-Overture-Node"] == "node1"
        for n in ("node0", "node1"):
            await call(c, "POST", f"/admin/nodes/{n}/undrain")
        # The next turn extends the prompt: node1's device holds its prefix. (Both idle:
        # least loaded alone would pick node0.)
        more = [*first, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and the mountains?"}]
        for _ in range(2):
            status, body, headers = await call(c, "POST", "/v1/chat/completions",
                                               {"model": "demo", "messages": more,
                                                "max_tokens": 3}, {"X-Session-Id": "s1"})
            assert status == 200 and headers["X-Overture-Node"] == "node1", body
        sent = c.engines[1].requests[-1]
        assert sent.device_only and not sent.no_reuse and sent.kv_source == ""
        # Another conversation holds no prefix anywhere: the least loaded (a tie: node0).
        other = [{"role": "user", "content": "zyxwvutsrq" * 20}]
        status, _, headers = await call(c, "POST", "/v1/chat/completions",
                                        {"model": "demo", "messages": other, "max_tokens": 3},
                                        {"X-Session-Id": "s2"})
        assert status == 200 and headers["X-Overture-Node"] == "node0"


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
    m = PrefixIndex(capacity=4)
    p1 = prompt_prefix("t", "m", "", [SYSTEM, ("user", "q"), ("assistant", "a"), ("user", "b")])
    m.turn_ended("t", "s1", p1[:1], "node0")
    m.turn_ended("t", "s2", p1, "node1")
    assert m.holders(p1) == ("node1",)
    assert m.holders(p1[:1]) == ("node1", "node0")
    m.saved("t", "s1", "node2")  # a save report: node2's kvstore holds s1's prefix too
    assert m.holders(p1[:1]) == ("node2", "node1", "node0")
    m.forget_node("node2")
    assert m.holders(p1[:1]) == ("node1", "node0")
    for i in range(5):  # bounded: a node's least recently recorded hashes go
        m.served("node1", (f"h{i}",))
    assert m.size("node1") == 4 and m.holders(p1) == ("node0",)
    m.forget_node("node0")
    assert m.holders(p1) == () and len(m) == 4


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


async def test_a_node_that_registers_again_holds_only_what_it_reports() -> None:
    """A restarted node's device is empty and its kvstore holds what its registration
    says: both prefix maps forget the rest (they kept routing to holders that were gone)."""
    registry = NodeRegistry(3.0)
    sessions = SessionDirectory(100, 600.0)
    config = load(SchedulerConfig, "scheduler", overrides={"policy": "prefix", "anonymous": True})
    channels = NodeChannels()
    state = build_state(config, registry, channels, sessions)
    prefixes, device = state.dispatcher.prefixes, state.dispatcher.prefix_index
    assert device is not None
    servicer = SchedulerServicer(registry, 0.1, sessions, leader=lambda: True,
                                 prefixes=prefixes)
    kept, lost = ("k0", "k1"), ("l0", "l1")
    prefixes.turn_ended("t", "kept", kept, "a")
    prefixes.turn_ended("t", "lost", lost, "a")
    device.served("a", ["b0", "b1"])
    request = scheduler_pb2.RegisterNodeRequest(node_id="a", address="127.0.0.1:1")
    request.sessions.add(tenant="t", session_id="kept", tokens=64)
    await servicer.RegisterNode(request, context=None)
    assert prefixes.holders(kept) == ("a",) and prefixes.holders(lost) == ()
    assert device.match("a", ["b0", "b1"]) == 0
    await channels.close()
