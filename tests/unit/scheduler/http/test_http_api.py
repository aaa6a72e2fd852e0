"""The scheduler's HTTP layer end to end in one process: real scheduler and node manager,
fake engine (see conftest)."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack

import grpc

from tests.unit.scheduler.conftest import MiniCluster, make_cluster
from tests.unit.scheduler.fake_engine import FakeEngine

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def sse_events(text: str) -> list:
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:]) for f in frames]


async def post(c: MiniCluster, path: str, body: object, **kw: object) -> tuple[int, object]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with c.http.post(c.url + path, data=data, **kw) as r:
        text = await r.text()
        if r.content_type == "text/event-stream":
            return r.status, sse_events(text)
        return r.status, json.loads(text)


async def test_chat_completion_carries_session_tenant_priority(cluster: MiniCluster) -> None:
    status, body = await post(
        cluster,
        "/v1/chat/completions",
        {**CHAT, "priority": 3, "return_token_ids": True},
        headers={"X-Session-Id": "s-42"},
    )
    assert status == 200, body
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["content"] == "t0 t1 t2 t3 "
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == [0, 1, 2, 3]
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["total_tokens"] == 7
    sent = cluster.engine.requests[-1]
    assert (sent.session_id, sent.tenant, sent.priority) == ("s-42", "default", 3)
    assert sent.add_generation_prompt is True


async def test_streamed_chat_with_usage(cluster: MiniCluster) -> None:
    status, events = await post(
        cluster,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]]
    assert "".join(content) == "t0 t1 t2 t3 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len({c["id"] for c in chunks}) == 1


async def test_n_choices_fan_out(cluster: MiniCluster) -> None:
    status, events = await post(
        cluster,
        "/v1/completions",
        {
            "model": "demo",
            "prompt": "a b",
            "max_tokens": 2,
            "n": 3,
            "seed": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        },
    )
    assert status == 200
    finished = {c["choices"][0]["index"] for c in events[:-2] if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1, 2}
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert events[-2]["usage"]["prompt_tokens"] == 2
    assert sorted(r.sampling.seed for r in cluster.engine.requests[-3:]) == [10, 11, 12]
    status, body = await post(cluster, "/v1/completions", {"prompt": "a", "max_tokens": 1, "n": 2})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["model"] == "demo"  # no model given: the cluster's default


async def test_errors_from_the_engine_and_the_scheduler(cluster: MiniCluster) -> None:
    long_prompt = " ".join(["w"] * 80)
    for stream in (False, True):
        status, body = await post(
            cluster, "/v1/completions", {"model": "demo", "prompt": long_prompt, "stream": stream}
        )
        assert status == 400, body
        assert "context" in body["error"]["message"]
    status, body = await post(cluster, "/v1/chat/completions", {**CHAT, "model": "nope"})
    assert (status, body["error"]["code"], body["error"]["param"]) == (
        404,
        "model_not_found",
        "model",
    )
    status, body = await post(cluster, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = await post(cluster, "/v1/chat/completions", {**CHAT, "temperature": 9})
    assert (status, body["error"]["param"]) == (400, "temperature")
    async with cluster.http.get(cluster.url + "/v1/nothing") as r:
        assert r.status == 404 and "error" in await r.json()
    cluster.engine.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    status, body = await post(cluster, "/v1/chat/completions", CHAT)
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    registry = cluster.scheduler.state.registry
    while any(registry.behind(n) for n in registry.all()):  # until a beat says it caught up
        await asyncio.sleep(0.02)
    cluster.engine.fail_with = grpc.StatusCode.INTERNAL
    status, body = await post(cluster, "/v1/chat/completions", CHAT)
    assert status == 500 and set(body["error"]) == {"message", "type", "param", "code"}


async def test_body_limit_and_auth() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, max_body_bytes=2048, api_keys={"sk-acme-1": "acme"})
        auth = {"Authorization": "Bearer sk-acme-1"}
        status, body = await post(c, "/v1/chat/completions", CHAT)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
        status, _ = await post(
            c, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer x"}
        )
        assert status == 401
        async with c.http.get(c.url + "/v1/models") as r:
            assert r.status == 401
        status, body = await post(c, "/v1/chat/completions", CHAT, headers=auth)
        assert status == 200
        assert c.engine.requests[-1].tenant == "acme"
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4000}]}
        status, body = await post(c, "/v1/chat/completions", big, headers=auth)
        assert status == 413 and "error" in body


async def test_no_node_gives_503_without_hanging() -> None:
    from services.scheduler.app import start
    from services.scheduler.config import SchedulerConfig
    from shared.config import load

    async with AsyncExitStack() as stack:
        cfg = load(
            SchedulerConfig,
            "scheduler",
            overrides={"port": 0, "grpc_port": 0, "no_node_wait_s": 0.2, "anonymous": True},
        )
        s = await start(cfg, stack)
        import aiohttp

        http = await stack.enter_async_context(aiohttp.ClientSession())
        url = f"http://127.0.0.1:{s.http_port}"
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "no_healthy_node"
        async with http.get(url + "/readyz") as r:
            assert r.status == 503
        async with http.get(url + "/healthz") as r:
            assert r.status == 200


async def test_disconnect_cancels_the_engine_generation() -> None:
    async with AsyncExitStack() as stack:
        engine = FakeEngine(max_model_len=10_000, token_delay_s=0.02)
        c = await make_cluster(stack, engine=engine)
        body = {**CHAT, "max_tokens": 5000, "stream": True}
        async with c.http.post(c.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()
            assert engine.running == 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while engine.running or engine.cancelled == 0:
            assert loop.time() < deadline, "engine generation was not cancelled"
            await asyncio.sleep(0.02)
        assert engine.cancelled == 1
        registry = c.scheduler.state.registry
        while registry.all()[0].routed:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        async with c.http.get(c.url + "/metrics") as r:
            text = await r.text()
        assert 'overture_requests_total{route="/v1/chat/completions",status="499"} 1.0' in text
        assert "overture_requests_in_flight 0.0" in text


async def test_dead_engine_takes_the_node_out_and_requests_fail_fast() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack)
        await c.engine_servers[0].server.stop(0)
        status, body = await post(c, "/v1/chat/completions", CHAT)
        assert status == 503, body
        await c.wait_nodes(0)
        async with c.http.get(c.url + "/readyz") as r:
            ready = await r.json()
            assert r.status == 503
            assert "engine" in ready["nodes"]["node0"]["problem"]
        async with c.http.get(c.url + "/v1/models") as r:
            assert (await r.json())["data"] == []
        status, body = await post(c, "/v1/chat/completions", CHAT)
        assert status == 503 and "node0" in body["error"]["message"]


async def test_models_health_and_metrics(cluster: MiniCluster) -> None:
    await post(cluster, "/v1/chat/completions", {**CHAT, "stream": True})
    async with cluster.http.get(cluster.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("demo", 64)]
    async with cluster.http.get(cluster.url + "/readyz") as r:
        assert r.status == 200 and (await r.json())["healthy_nodes"] == ["node0"]
    async with cluster.http.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert 'overture_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'overture_time_to_first_token_seconds_count{model="demo"} 1.0' in text
    assert 'overture_inter_token_latency_seconds_count{model="demo"} 3.0' in text
    assert "overture_healthy_nodes 1.0" in text
    assert 'overture_node_load{kind="routed",node="node0"} 0.0' in text
    assert "overture_requests_in_flight 0.0" in text


async def test_requests_spread_over_nodes() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, nodes=2, token_delay_s=0.01)
        results = await asyncio.gather(
            *(post(c, "/v1/chat/completions", {**CHAT, "max_tokens": 10}) for _ in range(4))
        )
        assert all(s == 200 for s, _ in results)
        # Routed work counts as load at once, so concurrent requests alternate nodes.
        assert [len(e.requests) for e in c.engines] == [2, 2]
