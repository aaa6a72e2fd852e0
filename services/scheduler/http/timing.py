"""Latency of one request as the metrics see it: time to first token, inter-token latency
per choice, tokens generated, and (for catalogue models) whether it met its SLOs."""

from __future__ import annotations

import functools
import time

from services.scheduler.metrics import SchedulerMetrics
from shared.model_catalog import ModelEntry


class Timing:
    """TTFT per request and inter-token latency per choice; with the model's SLOs (the
    catalogue's), whether the request met them (``done``)."""

    def __init__(self, metrics: SchedulerMetrics, model: str,
                 slo: ModelEntry | None = None) -> None:
        # (labelled at the first token: a model name nobody serves never becomes a label)
        self.ttft = functools.partial(metrics.ttft.labels, model)
        self.itl = functools.partial(metrics.itl.labels, model)
        self.generated = functools.partial(metrics.tokens.labels, model)
        self.attained = functools.partial(metrics.slo_attained.labels, model)
        self.slo = slo
        self.start = time.monotonic()
        self.first = False
        self.first_at = 0.0
        self.last: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.began: dict[int, float] = {}

    def done(self) -> None:
        """The request ended: count whether it met its model's TTFT and TPOT SLOs."""
        if self.slo is None or not self.first:
            return
        ttft = self.first_at - self.start
        self.attained("ttft", "yes" if ttft <= self.slo.ttft_slo_s else "no").inc()
        tpots = [(self.last[i] - self.began[i]) / (n - 1)
                 for i, n in self.count.items() if n > 1]
        if tpots:
            ok = max(tpots) <= self.slo.tpot_slo_s
            self.attained("tpot", "yes" if ok else "no").inc()

    def tokens(self, index: int, count: int) -> None:
        if count <= 0:
            return
        self.generated().inc(count)
        now = time.monotonic()
        if not self.first:
            self.first = True
            self.first_at = now
            self.ttft().observe(now - self.start)
        self.began.setdefault(index, now)
        self.count[index] = self.count.get(index, 0) + count
        prev = self.last.get(index)
        if prev is not None:
            gap = (now - prev) / count
            itl = self.itl()
            for _ in range(count):
                itl.observe(gap)
        self.last[index] = now
