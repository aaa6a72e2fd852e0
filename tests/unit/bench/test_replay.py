"""Replaying a trace against a scheduler (fake engines): every turn of every session is
sent in order, advised first unless the trace missed it, spurious advisories are sent
too, and the summary counts what happened."""

from __future__ import annotations

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
