"""The scheduler under overload and faults, on an in-process two-node cluster (real
scheduler and node managers, fake engines): keepalives are not output, a silent node's
streams are cut (or retried elsewhere before any output) and it leaves rotation, a node
that is behind is skipped and 429 + Retry-After comes only once every node is, and a node
whose kvstore does not answer is degraded but serves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import grpc
import pytest

from shared.grpc_server import serve_grpc
from tests.unit.scheduler.conftest import MiniCluster, make_cluster

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@pytest.fixture
async def two() -> AsyncIterator[MiniCluster]:
    async with AsyncExitStack() as stack:
        yield await make_cluster(stack, nodes=2, stream_idle_timeout_s=0.5,
                                 heartbeat_timeout_s=5.0)


async def post(c: MiniCluster, body: dict) -> tuple[int, str, dict]:
    async with c.http.post(c.url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.text(), dict(r.headers)


async def test_keepalives_are_not_output(two: MiniCluster) -> None:
    # The first engine asked sends keepalives, then fails as unreachable. Keepalives are
    # not output, so the request is re-routed to the other node, not failed.
    budget = [1]
    for e in two.engines:
        e.keepalives, e.fail_with, e.fail_budget = 3, grpc.StatusCode.UNAVAILABLE, budget
    status, text, _ = await post(two, dict(CHAT, stream=True))
    assert status == 200, text
    assert budget == [0] and sum(len(e.requests) for e in two.engines) == 2
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e.get("choices")) == "t0 t1 t2 "
    metrics = await (await two.http.get(two.url + "/metrics")).text()
    assert 'kv_from="unknown"' not in metrics  # the first real chunk was counted


async def test_a_silent_node_before_any_output_is_retried_elsewhere(two: MiniCluster) -> None:
    two.engines[0].stall_after = 0
    two.engines[1].stall_after = 0
    two.engines[1].keepalives = 0
    # Whichever node is picked first hangs; the other one is healed once that call is made.
    async def heal() -> None:
        while not any(e.requests for e in two.engines):
            await asyncio.sleep(0.01)
        hung = next(e for e in two.engines if e.requests)
        other = next(e for e in two.engines if e is not hung)
        other.stall_after = None

    healer = asyncio.create_task(heal())
    status, text, headers = await post(two, CHAT)
    await healer
    assert status == 200, text
    served = headers["X-Overture-Node"]
    hung = "node0" if two.engines[0].stall_after == 0 else "node1"
    assert served != hung
    text_metrics = await (await two.http.get(two.url + "/metrics")).text()
    assert f'overture_streams_stalled_total{{node="{hung}"}} 1.0' in text_metrics


async def test_a_node_that_stops_mid_stream_ends_it_with_a_clean_error(
    two: MiniCluster,
) -> None:
    for e in two.engines:
        e.stall_after = 1
    body = dict(CHAT, stream=True)
    status, text, _ = await post(two, body)
    assert status == 200  # the stream had started
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "node_stalled" and "stopped answering" in error["message"]


async def test_behind_nodes_are_skipped_then_429_with_retry_after() -> None:
    async with AsyncExitStack() as stack:
        # A long hold: the skipping below must not depend on how fast this machine is.
        two = await make_cluster(stack, nodes=2, behind_hold_s=30.0)
        await _behind_then_429(two)


async def _behind_then_429(two: MiniCluster) -> None:
    two.engines[0].fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    for e in two.engines:
        e.waiting = 5  # (reported in beats: a queue that is not empty)
    for _ in range(4):  # whichever node comes first, node1 serves
        status, text, headers = await post(two, CHAT)
        assert status == 200 and headers["X-Overture-Node"] == "node1", text
    # node0 refused once and is routed around since: no round trip per request.
    assert len(two.engines[0].requests) == 1
    two.engines[1].fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    status, text, headers = await post(two, CHAT)
    assert status == 429 and headers["Retry-After"] == "1"
    error = json.loads(text)["error"]
    assert error["code"] == "overloaded" and error["type"] == "rate_limit_error"
    # Both nodes stay in rotation: behind is not down.
    assert len(two.scheduler.state.registry.healthy()) == 2
    text_metrics = await (await two.http.get(two.url + "/metrics")).text()
    assert "overture_overloaded_total 1.0" in text_metrics
    # Until the hold ends or a beat reports an empty queue, both are skipped without a
    # call: 429 at once.
    calls = [len(e.requests) for e in two.engines]
    status, _, _ = await post(two, CHAT)
    assert status == 429 and [len(e.requests) for e in two.engines] == calls
    for e in two.engines:
        e.fail_with, e.waiting = None, 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while (status := (await post(two, CHAT))[0]) != 200:
        assert status == 429 and loop.time() < deadline
        await asyncio.sleep(0.05)


async def test_a_node_without_its_kvstore_is_degraded_but_serves(two: MiniCluster) -> None:
    # node1's kvstore answers health checks; node0's address has nothing behind it.
    async with serve_grpc("127.0.0.1", two.kvstore_ports[1], register=[],
                          service_names=["overture.v1.KVStore"], grace_s=0.1):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while True:
            async with two.http.get(two.url + "/readyz") as r:
                ready = await r.json()
            states = {n: v["state"] for n, v in ready["nodes"].items()}
            if states == {"node0": "degraded", "node1": "serving"}:
                break
            assert loop.time() < deadline, ready
            await asyncio.sleep(0.05)
        assert ready["degraded_nodes"] == ["node0"]
        assert "kvstore" in ready["nodes"]["node0"]["degraded"]
        assert sorted(ready["healthy_nodes"]) == ["node0", "node1"]
        text_metrics = await (await two.http.get(two.url + "/metrics")).text()
        assert 'overture_node_degraded{node="node0"} 1.0' in text_metrics
        assert 'overture_node_degraded{node="node1"} 0.0' in text_metrics


@pytest.mark.parametrize("stream", [True, False])
async def test_an_engine_crash_before_any_output_is_retried_once_elsewhere(
        two: MiniCluster, stream: bool) -> None:
    # The first engine asked starts its stream, then fails as a crashing engine does.
    budget = [1]
    for e in two.engines:
        e.keepalives, e.fail_with, e.fail_budget = 2, grpc.StatusCode.UNKNOWN, budget
    status, text, _ = await post(two, dict(CHAT, stream=stream))
    assert status == 200, text
    if stream:
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        assert not [e for e in events if "error" in e], events
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                          if e.get("choices"))
    else:
        content = json.loads(text)["choices"][0]["message"]["content"]
    assert content == "t0 t1 t2 "
    # One engine crashed on it, the other answered it.
    assert budget == [0] and [len(e.requests) for e in two.engines] == [1, 1]
    metrics = await (await two.http.get(two.url + "/metrics")).text()
    assert "overture_requests_retried_after_node_failure_total 1.0" in metrics


async def test_a_crash_is_retried_once_only_and_a_bad_request_never(
        two: MiniCluster) -> None:
    for e in two.engines:  # every engine crashes: one retry, then the error
        e.fail_with, e.fail_budget = grpc.StatusCode.INTERNAL, None
    status, text, _ = await post(two, CHAT)
    assert status >= 500 and sum(len(e.requests) for e in two.engines) == 2, text
    for e in two.engines:
        e.requests.clear()
        e.fail_with = grpc.StatusCode.INVALID_ARGUMENT  # the request's fault: no retry
    status, text, _ = await post(two, CHAT)
    assert status == 400 and sum(len(e.requests) for e in two.engines) == 1, text
