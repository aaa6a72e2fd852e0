"""The evaluation's workload generator reproduces the statistics it claims: ShareGPT's
turn counts and session lengths, Gamma arrivals with the asked CV, human reading and
typing times, advisories before their requests, and the missed, spurious and priority
shares; the same seed gives the same trace."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.workloads.arrivals import gamma_gaps
from bench.workloads.human import Human
from bench.workloads.sessions import MEAN_TURNS, SINGLE_TURN_SHARE, session_shape
from bench.workloads.trace import build_trace


def test_sessions_are_shaped_like_sharegpt() -> None:
    rng = random.Random(1)
    shapes = [session_shape(rng, 1 << 20, 1 << 20) for _ in range(20_000)]
    turns = [len(s) for s in shapes]
    assert abs(sum(t == 1 for t in turns) / len(turns) - SINGLE_TURN_SHARE) < 0.01
    assert abs(statistics.mean(turns) - MEAN_TURNS) < 0.1
    tokens = [sum(t.user_tokens + t.answer_tokens for t in s) for s in shapes]
    assert 2000 < statistics.mean(tokens) < 2400  # "about 2.2k"
    assert max(tokens) > 10 * statistics.median(tokens)  # a heavy tail
    user = [t.user_tokens for s in shapes for t in s]
    answer = [t.answer_tokens for s in shapes for t in s]
    assert 185 < statistics.mean(user) < 215 and 400 < statistics.mean(answer) < 460


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_gaps_have_the_asked_mean_and_cv(cv: float) -> None:
    gaps = gamma_gaps(random.Random(2), 50_000, 4.0, cv)
    mean = statistics.mean(gaps)
    assert abs(mean - 4.0) < 0.1 * 4.0
    assert abs(statistics.pstdev(gaps) / mean - cv) < 0.1 * cv


def test_people_read_faster_than_they_type() -> None:
    h = Human(228.0, 40.0)
    assert h.reading_s(430) == pytest.approx(430 * 0.75 / 228 * 60)
    assert h.typing_s(200) == pytest.approx(200 * 0.75 / 40 * 60)


def test_a_trace_advises_each_turn_as_typing_starts() -> None:
    trace = build_trace(users=20, sessions_per_user=10, seed=3)
    for s in trace.sessions:
        for prev, turn in zip(s.turns, s.turns[1:], strict=False):
            assert turn.advisory_at is not None and turn.advisory_at < turn.request_at
            assert turn.advisory_at >= prev.request_at  # (after reading the last answer)
            assert turn.text and len(turn.text.split()) == max(1, round(
                turn.user_tokens * 0.75))
    events = trace.events()
    assert [e[0] for e in events] == sorted(e[0] for e in events)
    assert build_trace(users=20, sessions_per_user=10, seed=3) == trace  # deterministic


def test_missed_spurious_and_priority_shares() -> None:
    trace = build_trace(users=50, sessions_per_user=40, seed=4, missed=0.3, spurious=0.2,
                        priority=0.25)
    turns = [t for s in trace.sessions for t in s.turns]
    missed = sum(t.advisory_at is None for t in turns) / len(turns)
    spurious = sum(len(s.spurious_at) for s in trace.sessions) / len(turns)
    high = sum(s.priority > 0 for s in trace.sessions) / len(trace.sessions)
    assert abs(missed - 0.3) < 0.03 and abs(spurious - 0.2) < 0.03 and abs(high - 0.25) < 0.04
