"""Advisories the scheduler infers: a turn that ends calling tools announces the next one.

An agent's turn that ends with ``finish_reason: "tool_calls"`` (a Responses call with
``function_call`` items) is followed by the same session's next turn, carrying the tools'
results, once the tools have run; its prefix is exactly this turn's prompt and output.
Agent frameworks send no advisories, so the scheduler makes one itself (Symphony §3.5:
the call graph is known here without profiling), expected after the tools' usual latency.

How long a tool takes is learnt per tenant and tool name from the gaps between a
tool-call turn's end and the session's next turn: the median is the expected arrival, a
high percentile the advisory's expiry (past it the loop was abandoned and the session's
blocks give way). A turn calling several tools waits for the slowest. Before a tool has
``MIN_SAMPLES`` gaps, ``default_s`` stands in and the book's usual TTL bounds the wait.
Bounded: ``window`` gaps per tool, ``capacity`` tools (least recently used first).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass

MIN_SAMPLES = 3


@dataclass(frozen=True)
class Expected:
    arrival_s: float  # when the next turn is expected (the median)
    expiry_s: float  # when to give up on it (a high percentile); 0: the book's usual TTL


class ToolLatencies:
    """Event-loop only."""

    def __init__(self, default_s: float, quantile: float = 0.95, window: int = 64,
                 capacity: int = 10_000) -> None:
        self.default_s = default_s
        self.quantile = quantile
        self.window = window
        self.capacity = capacity
        self._gaps: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()

    def observe(self, tenant: str, tools: tuple[str, ...], gap_s: float) -> None:
        """The next turn came ``gap_s`` after a turn that called ``tools``."""
        for tool in tools:
            key = (tenant, tool)
            gaps = self._gaps.pop(key, None) or deque(maxlen=self.window)
            gaps.append(max(0.0, gap_s))
            self._gaps[key] = gaps
        while len(self._gaps) > self.capacity:
            self._gaps.popitem(last=False)

    def expected(self, tenant: str, tools: tuple[str, ...]) -> Expected:
        arrival, expiry = 0.0, 0.0
        for tool in tools or ("",):
            gaps = self._gaps.get((tenant, tool))
            if gaps is None or len(gaps) < MIN_SAMPLES:
                return Expected(max(arrival, self.default_s), 0.0)  # not learnt: the TTL
            ordered = sorted(gaps)
            arrival = max(arrival, statistics.median(ordered))
            high = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
            expiry = max(expiry, high)
        return Expected(arrival, max(expiry, arrival))
