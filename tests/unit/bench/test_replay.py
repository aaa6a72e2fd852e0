"""Replaying a trace against a scheduler (fake engines): every turn of every session is
sent in order, advised first unless the trace missed it, spurious advisories are sent
too, and the summary counts what happened."""

from __future__ import annotations

import dataclasses
import itertools
from contextlib import AsyncExitStack

from bench.workloads.replay import Replayer, summary
from bench.workloads.trace import build_trace
from tests.unit.scheduler.conftest import make_cluster
from tests.unit.scheduler.fake_engine import FakeEngine


async def test_a_trace_replays_in_order_with_its_advisories() -> None:
    trace = build_trace(users=3, sessions_per_user=2, seed=5, missed=0.3, spurious=0.3,
                        max_user=40, max_answer=8, mean_gap_s=1.0)
    turns = sum(len(s.turns) for s in trace.sessions)
    advised = sum(t.advisory_at is not None for s in trace.sessions for t in s.turns)
    spurious = sum(len(s.spurious_at) for s in trace.sessions)
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, nodes=2, engine=FakeEngine(max_model_len=1 << 20))
        replayer = Replayer(c.url, "demo", time_scale=0.002, max_answer_tokens=8)
        results = await replayer.run(trace)
    assert len(results) == turns and not [r for r in results if r.error]
    assert replayer.advisories == advised + spurious
    for s in trace.sessions:
        mine = [r for r in results if r.session_id == s.session_id]
        assert [r.turn for r in mine] == list(range(len(s.turns)))
        assert all(a.sent_at + a.e2e_s <= b.sent_at for a, b in itertools.pairwise(mine))
        assert [r.advised for r in mine] == [t.advisory_at is not None for t in s.turns]
    stats = summary(results)
    assert stats["requests"] == turns and stats["errors"] == 0
    assert 0 < stats["ttft_p50_s"] <= stats["ttft_p95_s"] and stats["requests_per_s"] > 0


async def test_a_request_refused_at_capacity_is_sent_again_after_retry_after() -> None:
    from aiohttp import web

    calls = []

    async def chat(request: web.Request) -> web.StreamResponse:
        calls.append(await request.json())
        if len(calls) == 1:
            return web.json_response({"error": {"code": "overloaded"}}, status=429,
                                     headers={"Retry-After": "0.05"})
        r = web.StreamResponse(headers={"X-Overture-Node": "node1"})
        await r.prepare(request)
        await r.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        await r.write(b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n')
        await r.write(b"data: [DONE]\n\n")
        return r

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        trace = build_trace(users=1, sessions_per_user=1, seed=3, max_user=8, max_answer=4)
        trace.sessions[:] = [dataclasses.replace(trace.sessions[0],
                                                 turns=trace.sessions[0].turns[:1])]
        results = await Replayer(f"http://127.0.0.1:{port}", "m", time_scale=0.001).run(trace)
    finally:
        await runner.cleanup()
    (r,) = results
    assert len(calls) == 2 and calls[0] == calls[1]
    assert not r.error and r.retries == 1 and r.node == "node1" and r.ttft_s >= 0.05
    assert summary(results)["retried"] == 1
