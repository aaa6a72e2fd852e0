"""The scheduler's side of "KV follows the session", on an in-process two-node cluster
(real scheduler and node managers, fake engines): a turn on another node than the last
one names where the KV is; save reports reach the scheduler; drain, the admin routes,
the node header and the per-source metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from services.scheduler.cluster import HOLDER_SLACK, SessionPlace
from services.scheduler.routing import RouteRequest, node_request
from shared.proto import common_pb2
from tests.unit.scheduler.conftest import MiniCluster, make_cluster

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@pytest.fixture
async def two() -> AsyncIterator[MiniCluster]:
    async with AsyncExitStack() as stack:
        yield await make_cluster(stack, nodes=2)


async def call(c: MiniCluster, method: str, path: str, body: object = None,
               headers: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body)
    async with c.http.request(method, c.url + path, data=data, headers=headers or {}) as r:
        return r.status, json.loads(await r.text()), dict(r.headers)


async def serve_only(c: MiniCluster, node: str) -> None:
    for n in ("node0", "node1"):
        status, _, _ = await call(c, "POST", f"/admin/nodes/{n}/"
                                  f"{'undrain' if n == node else 'drain'}")
        assert status == 200
    assert [n.node_id for n in c.scheduler.state.registry.healthy()] == [node]


async def turn(c: MiniCluster, session: str) -> tuple[dict, str]:
    status, body, headers = await call(c, "POST", "/v1/chat/completions", CHAT,
                                       {"X-Session-Id": session})
    assert status == 200, body
    return body, headers["X-Overture-Node"]


async def test_the_next_turn_on_another_node_names_where_the_kv_is(two: MiniCluster) -> None:
    await serve_only(two, "node0")
    body, node = await turn(two, "s1")
    assert node == "node0"
    first = body["usage"]["total_tokens"]
    await serve_only(two, "node1")
    _, node = await turn(two, "s1")
    assert node == "node1"
    sent = two.engines[1].requests[-1]
    assert sent.kv_source == f"127.0.0.1:{two.kvstore_ports[0]}"  # node0's kvstore
    assert sent.kv_source_tokens == first
    # Back on node1 again: its own KV, no source named.
    _, node = await turn(two, "s1")
    assert node == "node1" and two.engines[1].requests[-1].kv_source == ""
    # A session never seen, and a request without a session, name none.
    await turn(two, "fresh")
    assert two.engines[1].requests[-1].kv_source == ""


async def test_a_dead_holder_is_not_named(two: MiniCluster) -> None:
    await serve_only(two, "node0")
    await turn(two, "s2")
    await serve_only(two, "node1")
    reg = two.scheduler.state.registry
    reg.suspend("node0", 60.0)  # unreachable: its kvstore is not worth a try
    await turn(two, "s2")
    assert two.engines[1].requests[-1].kv_source == ""


async def test_save_reports_reach_the_scheduler_and_the_admin_view(two: MiniCluster) -> None:
    await serve_only(two, "node0")
    await turn(two, "s3")
    two.engines[0].save("default", "s3", 41)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        status, where, _ = await call(two, "GET", "/admin/sessions/s3")
        assert status == 200, where
        if where["saved_tokens"] == 41:
            break
        assert loop.time() < deadline, where
        await asyncio.sleep(0.05)
    assert where["node"] == "node0"
    assert where["kvstore_address"] == f"127.0.0.1:{two.kvstore_ports[0]}"
    assert where["node_alive"] is True and where["turn_tokens"] > 0
    # The node manager asks only for saves after the ones the scheduler acknowledged.
    while max(two.engines[0].status_calls) < 1:
        assert loop.time() < deadline
        await asyncio.sleep(0.05)
    status, missing, _ = await call(two, "GET", "/admin/sessions/nope")
    assert status == 404 and missing["error"]["code"] == "session_not_found"


async def test_a_save_report_teaches_a_scheduler_that_never_saw_the_turn(
    two: MiniCluster,
) -> None:
    two.engines[1].save("default", "learnt", 77)
    sessions = two.scheduler.state.dispatcher.sessions
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while sessions.where("default", "learnt") is None:
        assert loop.time() < deadline
        await asyncio.sleep(0.05)
    await serve_only(two, "node0")
    await turn(two, "learnt")
    sent = two.engines[0].requests[-1]
    assert sent.kv_source == f"127.0.0.1:{two.kvstore_ports[1]}"
    assert sent.kv_source_tokens == 77


async def test_drain_and_undrain(two: MiniCluster) -> None:
    status, node, _ = await call(two, "POST", "/admin/nodes/node0/drain")
    assert status == 200 and node["drained"] is True and node["alive"] is True
    status, ready, _ = await call(two, "GET", "/readyz")
    assert ready["healthy_nodes"] == ["node1"] and ready["nodes"]["node0"]["in_rotation"] is False
    for _ in range(3):
        assert (await turn(two, "x"))[1] == "node1"
    status, listing, _ = await call(two, "GET", "/admin/nodes")
    assert [n["drained"] for n in listing["nodes"]] == [True, False]
    status, _, _ = await call(two, "POST", "/admin/nodes/node0/undrain")
    assert status == 200 and len(two.scheduler.state.registry.healthy()) == 2
    status, err, _ = await call(two, "POST", "/admin/nodes/node9/drain")
    assert status == 404 and err["error"]["code"] == "node_not_found"


async def test_turns_are_counted_by_where_their_kv_was(two: MiniCluster) -> None:
    two.engines[0].kv_from = two.engines[1].kv_from = "peer"
    await turn(two, "m")
    async with two.http.get(two.url + "/metrics") as r:
        text = await r.text()
    assert 'overture_turns_total{kv_from="peer"} 1.0' in text
    assert "overture_sessions_located 1.0" in text


async def test_admin_routes_need_an_admin_key_once_keys_are_configured() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, api_keys={"user-key": "acme"}, admin_keys=["root-key"])
        for headers, code in (({}, 401), ({"Authorization": "Bearer user-key"}, 403)):
            status, err, _ = await call(c, "POST", "/admin/nodes/node0/drain", headers=headers)
            assert status == code and err["error"]["code"] in ("invalid_admin_key",
                                                                "not_admin")
        status, _, _ = await call(c, "POST", "/admin/nodes/node0/drain",
                                  headers={"Authorization": "Bearer root-key"})
        assert status == 200


async def test_ties_go_to_the_node_holding_the_kv(two: MiniCluster) -> None:
    await serve_only(two, "node1")
    await turn(two, "tie")
    for n in ("node0", "node1"):
        await call(two, "POST", f"/admin/nodes/{n}/undrain")
    # Both idle: the balanced policy's tie goes to node1, which holds the session's KV.
    for _ in range(3):
        assert (await turn(two, "tie"))[1] == "node1"


@pytest.mark.parametrize("policy", ["sticky", "recompute"])
async def test_the_baseline_policies_move_no_kv(policy: str) -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, nodes=2, policy=policy)
        await serve_only(c, "node0")
        await turn(c, "s1")
        await serve_only(c, "node1")  # the holder left rotation: even sticky moves on
        _, node = await turn(c, "s1")
        sent = c.engines[1].requests[-1]
        assert node == "node1" and sent.kv_source == ""  # nothing is pulled across
        assert sent.no_reuse == (policy == "recompute")


async def test_a_holder_whose_heartbeat_is_late_is_still_named(two: MiniCluster) -> None:
    # A busy host's heartbeat comes late: its kvstore is still asked (one bounded lookup)
    # rather than recomputing the session's history; one silent for long is not.
    d, reg = two.scheduler.state.dispatcher, two.scheduler.state.registry
    holder, serving = reg.get("node0"), reg.get("node1")
    assert holder is not None and serving is not None
    place = SessionPlace("node0", turn_tokens=50)
    plan = d.policy.route([serving], RouteRequest(serving.info.models[0].name, "s",
                                                  holder="node0"))
    assert plan is not None and plan.pull_from == "node0"
    request = common_pb2.GenerateRequest()
    # (synchronous from here: no heartbeat can land between setting the beat and asking)
    holder.last_beat = reg.clock() - reg.timeout * 1.5
    assert not reg.alive(holder)
    assert node_request(request, plan, place, reg).kv_source == f"127.0.0.1:{two.kvstore_ports[0]}"
    holder.last_beat = reg.clock() - reg.timeout * (HOLDER_SLACK + 1)
    assert node_request(request, plan, place, reg).kv_source == ""
