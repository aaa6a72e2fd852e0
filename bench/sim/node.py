"""One simulated engine: a queue, continuous batching, and the time each step takes.

Mirrors the engine's scheduler in the large: requests are admitted in order (higher
priority first) while seats (``max_num_seqs``) and device blocks allow; every step runs
one token of every decoding sequence plus prefill chunks within ``max_batched_tokens``.
A request holds the blocks of its whole prompt and answer from admission (the real engine
grows them as it goes; holding them up front keeps the model free of preemption). KV
loaded from a tier delays the request: with ``layerwise`` loading the forward pass waits
for the layers (the step lasts at least until the load ends: load and compute overlap);
without, the request computes only after the whole load (load, then compute).

Steps of pure decoding with nothing to admit are simulated together up to the next
finish; an arrival cuts such a run short at the step in flight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.sim.costs import Calibration


@dataclass(eq=False)
class Req:
    session_id: str
    turn: int
    advised: bool
    priority: int
    sent_at: float
    context: int  # history tokens before this turn
    user: int  # new tokens of the user's message
    out: int  # answer tokens
    arrival: int = 0
    table: list[list[int]] = field(default_factory=list)
    to_compute: int = 0  # prompt tokens to prefill (the rest were on device or loaded)
    computed: int = 0
    cached: int = 0
    ready_at: float = 0.0  # its whole-prefix load ends (no layerwise loading)
    load_until: float = 0.0  # its layer-wise load ends
    generated: int = 0
    first_at: float = 0.0
    node: str = ""

    @property
    def prompt(self) -> int:
        return self.context + self.user


Admit = Callable[["SimNode", Req, float], bool]  # place the request's blocks; False: wait
Finish = Callable[["SimNode", Req, float], None]
Schedule = Callable[[float, "SimNode", int], None]  # (time, node, version): a step ends


class SimNode:
    def __init__(self, node_id: str, cal: Calibration, admit: Admit, finish: Finish,
                 schedule: Schedule) -> None:
        self.node_id = node_id
        self.cal = cal
        self._admit, self._finish, self._schedule = admit, finish, schedule
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.version = 0
        self.busy = False
        self.link_free_at = 0.0  # the node's ingress link (prefetch transfers queue on it)
        self._arrivals = 0
        # The step (or run of decode steps) in flight.
        self._start = self._dt = 0.0
        self._k = 0
        self._chunks: list[tuple[Req, int]] = []
        self._decodes: list[Req] = []

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def submit(self, req: Req, now: float) -> None:
        self._arrivals += 1
        req.arrival = self._arrivals
        req.node = self.node_id
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: (-r.priority, r.arrival))
        if not self.busy:
            self.step(now)
        elif self._k > 1:
            self._cut(now)

    def wake(self, now: float) -> None:
        """Memory may have been freed elsewhere (an advisory ended): retry admission."""
        if not self.busy and self.waiting:
            self.step(now)

    # -- steps ------------------------------------------------------------------------------

    def step(self, now: float) -> None:
        """Admit what fits and start the next step (or go idle)."""
        while self.waiting and len(self.running) < self.cal.max_num_seqs:
            if not self._admit(self, self.waiting[0], now):
                break
            self.running.append(self.waiting.pop(0))
        decodes = [r for r in self.running if r.generated > 0]
        budget = self.cal.max_batched_tokens - len(decodes)
        chunks: list[tuple[Req, int]] = []
        stall_until = now
        for r in self.running:
            if r.generated or budget <= 0 or r.ready_at > now:
                continue
            n = min(budget, r.to_compute - r.computed)
            chunks.append((r, n))
            budget -= n
            stall_until = max(stall_until, r.load_until)
        if not chunks and not decodes:
            loading = [r.ready_at for r in self.running if r.ready_at > now]
            self.busy = bool(loading)
            if loading:
                self._begin(now, min(loading) - now, 0, [], [])
            return
        ctx = sum(r.prompt + r.generated for r in decodes)
        dt = self.cal.step_s([(n, r.context + r.computed) for r, n in chunks], len(decodes), ctx)
        k = 1
        if not chunks and not self._could_admit() and not any(
                r.ready_at > now for r in self.running):
            k = min(r.out - r.generated for r in decodes)
            # (context grows by one token a step: take the run's middle)
            dt = self.cal.step_s([], len(decodes), ctx + len(decodes) * (k - 1) // 2)
        self.busy = True
        self._begin(now, max(dt, stall_until - now), k, chunks, decodes)

    def _could_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.cal.max_num_seqs

    def _begin(self, now: float, dt: float, k: int, chunks: list[tuple[Req, int]],
               decodes: list[Req]) -> None:
        self.version += 1
        self._start, self._dt, self._k = now, dt, k
        self._chunks, self._decodes = chunks, decodes
        self._schedule(now + dt * max(1, k), self, self.version)

    def _cut(self, now: float) -> None:
        """An arrival during a run of decode steps: end the run with the step in flight."""
        done = max(1, math.ceil((now - self._start) / self._dt - 1e-9)) if self._dt > 0 else 1
        if done < self._k:
            self._k = done
            self.version += 1
            self._schedule(self._start + self._dt * done, self, self.version)

    def step_ended(self, now: float, version: int) -> None:
        if version != self.version:
            return  # superseded (cut short)
        for r, n in self._chunks:
            r.computed += n
            if r.computed >= r.to_compute:
                r.generated, r.first_at = 1, now
        for r in self._decodes:
            r.generated += self._k
        done = [r for r in self.running if r.generated >= r.out]
        if done:
            self.running = [r for r in self.running if r.generated < r.out]
            for r in done:
                self._finish(self, r, now)
        self._chunks, self._decodes, self._k = [], [], 0
        self.busy = False
        self.step(now)
