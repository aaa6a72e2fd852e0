"""Prism's Algorithm 2 (Moore-Hodgson): hand-worked cases, and the fewest late requests
against brute force on small random queues."""

from __future__ import annotations

import itertools
import random

import pytest

from services.nodemgr.deadline_order import Waiting, deadline_order


def req(name: str, arrival: float, slo: float, prefill_s: float) -> Waiting[str]:
    return Waiting(name, arrival, slo, int(prefill_s * 1000), 1000.0)


def names(ws: list[Waiting[str]]) -> list[str]:
    return [w.item for w in ws]


def test_hand_worked_pop_of_the_longest() -> None:
    # Deadlines: A 2, B 3, C 4, D 5. Prefill: A 1, B 1.5, C 2.5, D 1.
    # A: t=1 <= 2. B: t=2.5 <= 3. C: t=5 > 4 -> pop the longest in S (C, 2.5): t=2.5.
    # D: t=3.5 <= 5. On time: A, B, D; C is served after them.
    q = [req("C", 0, 4, 2.5), req("A", 0, 2, 1), req("D", 0, 5, 1), req("B", 0, 3, 1.5)]
    on_time, late = deadline_order(q, now=0)
    assert names(on_time) == ["A", "B", "D"] and names(late) == ["C"]


def test_the_popped_request_need_not_be_the_last_added() -> None:
    # A (deadline 3, 2.5 s) first; B (deadline 3.2, 0.5 s) makes t = 3 ok; C (deadline 3.5,
    # 0.8 s) makes t = 3.8 > 3.5: pop A, the longest, leaving B, C on time (t = 1.3).
    q = [req("A", 0, 3, 2.5), req("B", 0, 3.2, 0.5), req("C", 0, 3.5, 0.8)]
    on_time, late = deadline_order(q, now=0)
    assert names(on_time) == ["B", "C"] and names(late) == ["A"]


def test_arrivals_and_now_count() -> None:
    # Arrived at 10 and 11 with SLO 2: deadlines 12 and 13; it is 11.5 now.
    q = [req("X", 10, 2, 1), req("Y", 11, 2, 1)]
    # X alone would end at 12.5 > 12: it is popped; Y then ends at 12.5 <= 13.
    on_time, late = deadline_order(q, now=11.5)
    assert names(on_time) == ["Y"] and names(late) == ["X"]
    on_time, _ = deadline_order(q, now=10.5)  # earlier, both make it: X ends 11.5, Y 12.5
    assert names(on_time) == ["X", "Y"]


def _best_on_time(q: list[Waiting[str]], now: float) -> int:
    """The most requests that can meet their deadlines, over every subset and order."""
    best = 0
    for k in range(len(q), 0, -1):
        for subset in itertools.combinations(q, k):
            for order in itertools.permutations(subset):
                t, ok = now, True
                for w in order:
                    t += w.prefill_s
                    if t > w.deadline:
                        ok = False
                        break
                if ok:
                    return k
    return best


@pytest.mark.parametrize("seed", range(60))
def test_fewest_late_against_brute_force(seed: int) -> None:
    rnd = random.Random(seed)
    n = rnd.randint(1, 6)
    q = [req(f"r{i}", rnd.uniform(0, 2), rnd.uniform(0.2, 3), rnd.uniform(0.1, 1.5))
         for i in range(n)]
    now = 1.0
    on_time, late = deadline_order(q, now)
    t = now
    for w in on_time:  # every scheduled request meets its deadline, in this order
        t += w.prefill_s
        assert t <= w.deadline + 1e-9
    assert len(on_time) == _best_on_time(q, now)
    assert sorted(names(on_time) + names(late)) == sorted(names(q))  # nothing dropped
