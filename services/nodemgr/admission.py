"""Node-local admission by TTFT deadline (Prism §6.3): one queue for all the node's models,
dispatched to their engines in the order of Algorithm 2 (``deadline_order``).

A request waits here until it is its turn and its engine can start it at once: each engine
takes at most ``depth`` requests that have not produced their first token yet (more would
only queue inside the engine, where the node could no longer reorder them). Whenever a
request arrives or one starts producing, the queue is ordered again: requests that can
still meet their deadline first (Moore-Hodgson keeps the most of them), then the others,
which are served all the same, after them: when none of the first kind waits, one at a
time into an engine with nothing else starting (the engines share the node's compute). Past
``max_waiting`` queued requests the node refuses new ones (429 upstream), and so it does a
request whose wait here would be over ``max_delay_s``: the prefill of the requests queued
for its engine ahead of it, ``depth`` at a time at its model's measured speed, or the age of
the oldest of them (the engine's own delay bound is off for the requests this queue
dispatches, so the bound is kept here, where they wait). An overload it cannot drain is the
cluster's to spread.

A request's prefill time is its prompt length (estimated from its text before the engine
tokenizes it) over its model's chunked-prefill speed, measured here from the requests it
served (prompt tokens over the time from dispatch to first token), starting from
``default_speed``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from services.nodemgr.deadline_order import Waiting, deadline_order

CHARS_PER_TOKEN = 4.0  # a prompt's length in tokens, estimated from its characters
SPEED_WEIGHT = 0.3  # EWMA weight of a new prefill-speed sample


class NodeQueueFull(RuntimeError):
    """The node's queue holds its maximum: retry later (or elsewhere)."""


@dataclass(eq=False)
class _Ticket:
    engine: str
    model: str = ""
    go: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                     .create_future())


class DeadlineAdmission:
    def __init__(self, depth: int = 4, default_speed: float = 2000.0,
                 slo: Callable[[str], float] = lambda model: 2.0,
                 clock: Callable[[], float] = time.monotonic, max_waiting: int = 1024,
                 max_delay_s: float = 0.0) -> None:
        self.depth = depth
        self.max_waiting = max_waiting
        self.max_delay_s = max_delay_s  # 0: only max_waiting refuses
        self.default_speed = default_speed
        self._slo = slo
        self._clock = clock
        self.speed: dict[str, float] = {}  # model -> measured prefill tokens/s
        self._queue: list[Waiting[_Ticket]] = []
        self._starting: dict[str, int] = {}  # engine -> dispatched, no first token yet
        self.late = 0  # requests dispatched after their deadline had passed

    @asynccontextmanager
    async def slot(self, model: str, engine: str, prompt_tokens: int
                   ) -> AsyncIterator[Callable[[int], None]]:
        """Wait for the request's turn; yields ``first_token(prompt_tokens)`` to call when
        its first token arrives (its engine may then start another). Raises
        NodeQueueFull when ``max_waiting`` requests wait already."""
        if len(self._queue) >= self.max_waiting:
            raise NodeQueueFull(f"the node's queue is full ({self.max_waiting} waiting); "
                                "retry later")
        arrival = self._clock()
        self._check_delay(engine, arrival)
        ticket = _Ticket(engine, model)
        w = Waiting(ticket, arrival, self._slo(model), max(1, prompt_tokens),
                    self.speed.get(model, self.default_speed))
        self._queue.append(w)
        started = False
        dispatched = arrival

        def first_token(actual_tokens: int) -> None:
            nonlocal started
            if started:
                return
            started = True
            # From dispatch, not arrival: time spent in this queue is not prefill speed.
            elapsed = self._clock() - dispatched
            if actual_tokens > 0 and elapsed > 0:
                sample = actual_tokens / elapsed
                old = self.speed.get(model)
                self.speed[model] = sample if old is None else (
                    (1 - SPEED_WEIGHT) * old + SPEED_WEIGHT * sample)
            self._starting[engine] -= 1
            self._pump()

        try:
            self._pump()
            await ticket.go
            dispatched = self._clock()
            if dispatched > w.deadline:
                self.late += 1
            yield first_token
        finally:
            if ticket.go.done() and not ticket.go.cancelled():
                first_token(0)  # (ended or failed before its first token)
            else:
                if w in self._queue:  # (a pump may have dropped it, cancelled, already)
                    self._queue.remove(w)
                ticket.go.cancel()

    def predicted_wait(self, engine: str, now: float) -> float:
        """Seconds a request for ``engine`` arriving now would wait here: the prefill of
        those queued for it, ``depth`` at a time (or the age of the oldest, if longer)."""
        ahead = [w for w in self._queue if w.item.engine == engine and not w.item.go.done()]
        if not ahead:
            return 0.0
        prefill = sum(w.prefill_s for w in ahead) / max(1, self.depth)
        return max(prefill, now - min(w.arrival for w in ahead))

    def _check_delay(self, engine: str, now: float) -> None:
        if not self.max_delay_s:
            return
        wait = self.predicted_wait(engine, now)
        if wait > self.max_delay_s:
            raise NodeQueueFull(f"the node is behind (a new request would wait about "
                                f"{wait:.2f}s in its queue, over {self.max_delay_s:g}s); "
                                "retry later")

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def queued(self, model: str) -> int:
        return sum(1 for w in self._queue if w.item.model == model)

    def _pump(self) -> None:
        """Dispatch, in Algorithm 2's order, every request of its schedule S whose engine
        can start it. A request S gave up on is served after the others (§6.3: only S
        is dispatched): when no request of S waits on the node, one at a time per
        engine, into an engine with nothing else starting, so that it takes no seat or
        prefill time from one that can still make its deadline (the engines share the
        node's compute)."""
        # A waiter cancelled meanwhile (its client went away) leaves in its own
        # ``finally``, a loop turn later: never dispatch it (its seat would be lost).
        self._queue = [w for w in self._queue if not w.item.go.done()]
        on_time, late = deadline_order(self._queue, self._clock())
        for w in on_time:
            if self._starting.get(w.item.engine, 0) < self.depth:
                self._dispatch(w)
        if len(self._queue) > len(late):  # (dispatched ones left: S still has waiters)
            return
        for w in late:
            if not self._starting.get(w.item.engine, 0):
                self._dispatch(w)

    def _dispatch(self, w: Waiting[_Ticket]) -> None:
        self._starting[w.item.engine] = self._starting.get(w.item.engine, 0) + 1
        self._queue.remove(w)
        w.item.go.set_result(None)


def estimate_tokens(chars: int, token_ids: int) -> int:
    """A request's prompt length before tokenization: its token ids, or its text / 4."""
    return token_ids or max(1, int(chars / CHARS_PER_TOKEN))
