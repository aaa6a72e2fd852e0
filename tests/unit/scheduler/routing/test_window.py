"""Each node's admission window at the scheduler (``routing/window.py``), worked by hand on
a fake clock, and a burst beyond the windows refused by the scheduler with 429 and
Retry-After instead of queued on the nodes (issue 43)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import AsyncExitStack

from services.scheduler.cluster import InFlight, ModelSpec, Node, NodeInfo
from services.scheduler.routing import NodeWindows, WindowSettings
from services.scheduler.routing.window import STEP
from services.scheduler.tenants import TOKEN_HEADER
from tests.unit.scheduler.conftest import Clock, MiniCluster, make_cluster

ON = WindowSettings(enabled=True, wait_s=0.5, min_window=2, min_scale=0.25, horizon_s=2.0)


def windows(settings: WindowSettings = ON) -> tuple[NodeWindows, InFlight, Clock]:
    clock = Clock()
    inflight = InFlight(clock=clock)
    return NodeWindows(settings, inflight, clock=clock), inflight, clock


def serve(inflight: InFlight, clock: Clock, node: str, count: int, held_s: float) -> None:
    """``count`` generations on ``node``, their first token now, ended ``held_s`` later."""
    tickets = [inflight.begin(node, 16) for _ in range(count)]
    for t in tickets:
        inflight.progress(t, 1)
    clock.now += held_s
    for t in tickets:
        inflight.end(t)


def node(node_id: str, routed: int) -> Node:
    return Node(NodeInfo(node_id, "addr", ()), 0.0, 0.0, routed=routed)


def test_an_unmeasured_node_has_the_smallest_window() -> None:
    w, _, _ = windows()
    assert w.window("a") == 2


def test_a_window_is_never_smaller_than_the_nodes_seats() -> None:
    """Measured at a light load, λ is that load: a burst after a quiet spell is not
    refused while the node has seats free (a model not saying its seats has 64)."""
    w, inflight, clock = windows()
    serve(inflight, clock, "a", 1, held_s=0.25)  # 0.5 a second: L = 0.5 × 0.75 → 1
    seated = Node(NodeInfo("a", "addr", (ModelSpec("m", seats=20),)), 0.0, 0.0, routed=19)
    assert w.window("a") == 2 and w.window("a", seats=20) == 20
    assert w.with_room([seated]) == [seated]
    assert w.with_room([dataclasses.replace(seated, routed=20)]) == []
    unsaid = Node(NodeInfo("a", "addr", (ModelSpec("m"),)), 0.0, 0.0, routed=63)
    assert w.with_room([unsaid]) == [unsaid]


def test_late_first_tokens_shrink_the_seats_floor_too() -> None:
    """Seats the node cannot start in time are no floor: at ten times a tiny model's
    capacity the 64 seats let most requests through to be refused by the nodes."""
    w, _, clock = windows()
    assert w.window("a", seats=64) == 64
    for _ in range(3):  # three late first tokens, a wait_s apart: scale 0.9³ = 0.729
        w.first_token("a", arrived=clock.now - 2.0)
        clock.now += 0.5
    assert w.window("a", seats=64) == 47  # ceil(64 × 0.729), the last late one 0.5 s ago
    for _ in range(300):  # the floor comes back with first tokens in time (STEP each)
        w.first_token("a", arrived=clock.now)
    assert w.window("a", seats=64) == 64
    w.first_token("a", arrived=clock.now - 2.0)  # late again: 0.9 × 1.0 → 58 seats
    assert w.window("a", seats=64) == 58
    clock.now += 2.5  # no lateness within the horizon (2 s): an idle node's seats are whole
    assert w.window("a", seats=64) == 64


def test_the_window_is_littles_law_of_the_measured_completions() -> None:
    w, inflight, clock = windows()
    serve(inflight, clock, "a", 20, held_s=0.25)
    # 20 ended within the 2 s horizon: 10 a second, each 0.25 s from first token to
    # end; L = λ·(Ŝ + wait) = 10 × (0.25 + 0.5) = 7.5 → 8 in flight.
    assert inflight.served("a", 2.0) == (10.0, 0.25)
    assert w.window("a") == 8
    # (b, unmeasured, has the smallest window: 2)
    assert [n.node_id for n in w.with_room([node("a", 7), node("b", 2)])] == ["a"]
    assert w.with_room([node("a", 8)]) == []
    # Two seconds on, those completions are out of the horizon, but the capacity they
    # showed is remembered, decaying over ten horizons: 10 × e^(-2/20) × 0.75 = 6.79.
    clock.now += 2.0
    assert w.window("a") == 7
    # A slower spell does not lower it at once (a full window bounds the completions).
    serve(inflight, clock, "a", 4, held_s=0.25)  # 2 a second now
    assert w.window("a") == 7
    clock.now += 100.0  # idle for long: forgotten (10 × e^(-5.1) × 0.75 < 1)
    assert w.window("a") == 2


def test_generations_without_tokens_do_not_count_as_completions() -> None:
    w, inflight, _ = windows()
    for _ in range(10):
        inflight.end(inflight.begin("a", 16))  # (refused, or failed before any token)
    assert inflight.served("a", 2.0) == (0.0, 0.0)
    assert w.window("a") == 2


def test_late_first_tokens_narrow_the_window_once_per_wait() -> None:
    w, inflight, clock = windows()
    serve(inflight, clock, "a", 20, held_s=0.25)  # Little's law: 7.5
    # Arrived 1.2 s ago: later than twice the 0.5 s wait.
    w.first_token("a", clock.now - 1.2)
    # Only the queue allowance narrows: 10 × (0.25 + 0.9 × 0.5) = 7.0
    assert w.scale("a") == 0.9 and w.window("a") == 7
    w.first_token("a", clock.now - 1.2)  # the same slow spell: no second cut
    assert w.scale("a") == 0.9
    clock.now += 0.5
    w.first_token("a", clock.now - 1.2)
    assert abs(w.scale("a") - 0.81) < 1e-12 and w.window("a") == 7  # ceil(6.55)
    for _ in range(2):
        clock.now += 0.5
        w.first_token("a", clock.now - 1.2)
    assert abs(w.scale("a") - 0.6561) < 1e-12 and w.window("a") == 6  # ceil(5.78)


def test_on_time_first_tokens_widen_it_back_up_to_littles_law() -> None:
    w, inflight, clock = windows()
    serve(inflight, clock, "a", 20, held_s=0.25)
    w.first_token("a", clock.now - 1.2)
    w.first_token("a", clock.now - 0.4)  # on time: one STEP back
    assert abs(w.scale("a") - (0.9 + STEP)) < 1e-12
    for _ in range(1000):
        w.first_token("a", clock.now - 0.4)
    assert w.scale("a") == 1.0 and w.window("a") == 8
    # Exactly twice the wait is still in time; an unknown arrival is not counted.
    w.first_token("a", clock.now - 1.0)
    w.first_token("a", 0.0)
    assert w.scale("a") == 1.0


def test_the_scale_stops_at_its_floor_and_the_running_part_stays() -> None:
    w, inflight, clock = windows(dataclasses.replace(ON, horizon_s=40.0))
    serve(inflight, clock, "a", 400, held_s=0.25)  # 10 a second over 40 s: 7.5 again
    for _ in range(20):  # 0.9 ** 14 < 0.25: the floor is reached on the way
        w.first_token("a", clock.now - 1.2)
        clock.now += 0.5
    assert w.scale("a") == 0.25
    assert w.window("a") == 4  # ceil(10 × (0.25 + 0.25 × 0.5) = 3.75)


def test_windows_off_limit_nothing() -> None:
    w, inflight, clock = windows(WindowSettings(enabled=False))
    serve(inflight, clock, "a", 20, held_s=0.25)
    w.first_token("a", clock.now - 5.0)
    assert w.window("a") == 0 and w.scale("a") == 1.0
    assert len(w.with_room([node("a", 10_000)])) == 1


async def _open_streams(c: MiniCluster, count: int) -> list:
    """``count`` streams whose first chunk came and whose engines then hang."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "stream": True}
    out = []
    for _ in range(count):
        r = await c.http.post(c.url + "/v1/chat/completions", json=body)
        assert r.status == 200, await r.text()
        out.append(r)
    return out


async def _burst_beyond_the_windows(window: bool) -> tuple[list[int], list[int], str]:
    """Two hung streams (one a node), then six more requests: the statuses of those
    answered, the requests each engine saw, the scheduler's metrics."""
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, nodes=2, stream_idle_timeout_s=120.0,
                               admission_window=window, admission_min_window=1,
                               seats=1 if window else 0)
        for e in c.engines:
            e.stall_after = 1  # one token, then hang: each stream stays in flight
        held = await _open_streams(c, 2)
        body = {"model": "demo", "messages": [{"role": "user", "content": "more"}],
                "max_tokens": 8}
        tasks = [asyncio.create_task(c.http.post(c.url + "/v1/chat/completions",
                                                 json=body)) for _ in range(6)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0  # (a bound on the wait, not a timing assert)
        while not (all(t.done() for t in tasks)
                   or sum(len(e.requests) for e in c.engines) == 8):
            assert loop.time() < deadline, "the burst was neither refused nor queued"
            await asyncio.sleep(0.02)
        statuses = []
        for t in tasks:
            if not t.done():
                t.cancel()
                continue
            r = t.result()
            statuses.append(r.status)
            if r.status == 429:
                assert r.headers["Retry-After"] == "1"
                error = json.loads(await r.text())["error"]
                assert error["code"] == "overloaded" and "window" in error["message"]
            r.release()
        if window:  # refused before its body is read: even a malformed one gets the 429
            async with c.http.post(c.url + "/v1/chat/completions", data=b"{not json") as r:
                assert r.status == 429 and r.headers[TOKEN_HEADER]  # (its place in line)
        seen = [len(e.requests) for e in c.engines]
        metrics = await (await c.http.get(c.url + "/metrics")).text()
        for r in held:
            r.close()
        return statuses, seen, metrics


async def test_a_burst_beyond_the_windows_is_refused_at_the_scheduler() -> None:
    statuses, seen, metrics = await _burst_beyond_the_windows(window=True)
    # One generation in flight on each node fills its window of one: every request of
    # the burst gets 429 with Retry-After from the scheduler, and no node saw it.
    assert statuses == [429] * 6
    assert seen == [1, 1]
    assert 'overture_admission_refusals_total{reason="window_full"} 7.0' in metrics
    assert 'overture_admission_window{node="node0"} 1.0' in metrics


async def test_without_windows_the_same_burst_is_queued_on_the_nodes() -> None:
    statuses, seen, _ = await _burst_beyond_the_windows(window=False)
    assert statuses == []  # (all six wait on the hung engines)
    assert sum(seen) == 8
