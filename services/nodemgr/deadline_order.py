"""The order a node dispatches queued requests of all its models in: Prism's GPU-local
request scheduling (Prism §6.3, Algorithm 2), which is Moore-Hodgson's rule for the fewest
late jobs on one machine.

A request r waits with a deadline for its first token, d_r = a_r + s_r (arrival + its
model's TTFT SLO), and needs e_r = p_r / c_r seconds of prefill (prompt tokens over its
model's measured chunked-prefill speed). In deadline order, each request joins the
schedule; when the one just added would finish past its deadline, the request of the
schedule with the longest prefill leaves it (Algorithm 2, lines 7-11). What remains can all
start in order and meet their deadlines, and no other choice meets more (Moore 1968; the
proof Prism cites is Cheriyan, Ravi and Skutella 2021). Requests that cannot be saved are
not dropped: they come after the others, still in deadline order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Waiting(Generic[T]):
    """One queued request: ``item`` is whatever the caller dispatches."""

    item: T
    arrival: float  # a_r (seconds, the caller's clock)
    ttft_slo_s: float  # s_r
    prompt_tokens: int  # p_r
    prefill_tokens_per_s: float  # c_r (its model's chunked-prefill speed)

    @property
    def deadline(self) -> float:
        return self.arrival + self.ttft_slo_s

    @property
    def prefill_s(self) -> float:
        return self.prompt_tokens / self.prefill_tokens_per_s


def deadline_order(queue: Sequence[Waiting[T]], now: float
                   ) -> tuple[list[Waiting[T]], list[Waiting[T]]]:
    """(on time, late): Algorithm 2's schedule S in dispatch order, then the requests it
    gave up on (to be served after S, earliest deadline first)."""
    ordered = sorted(queue, key=lambda w: w.deadline)  # line 1 (stable: FIFO on ties)
    schedule: list[Waiting[T]] = []  # line 2
    late: list[Waiting[T]] = []
    t = now
    for r in ordered:  # line 3
        schedule.append(r)  # line 5
        t += r.prefill_s  # line 6
        if t > r.deadline:  # line 7
            longest = max(range(len(schedule)), key=lambda i: schedule[i].prefill_s)  # line 9
            gone = schedule.pop(longest)  # line 10
            t -= gone.prefill_s  # line 11
            late.append(gone)
    late.sort(key=lambda w: w.deadline)
    return schedule, late
