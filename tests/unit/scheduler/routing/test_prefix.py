"""The ``prefix`` baseline (precise prefix-aware routing, as llm-d does it): the node whose
device holds the longest leading run of the prompt's block hashes wins, the least loaded
when none holds any; its plans keep KV in device memory only; and the index behind it
(chained hashes, a gap ends a match, least recently served blocks go first)."""

from __future__ import annotations

from contextlib import AsyncExitStack

from services.scheduler.cluster import Load
from services.scheduler.routing import PrefixIndex, RouteRequest, make_policy
from services.scheduler.routing.prefix_index import BLOCK_CHARS, block_hashes, prompt_text
from tests.unit.scheduler.conftest import make_cluster
from tests.unit.scheduler.routing.test_kv_follows import call, serve_only
from tests.unit.scheduler.routing.test_policy import pick, registry


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
    index = PrefixIndex(capacity_blocks=6)
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
