"""Back-pressure: refuse a new request while the engine cannot keep up.

An engine that queues everything it is sent turns overload into collapse: every request
waits behind the whole backlog and all of them miss their deadline. Instead a request is
refused at once (``RESOURCE_EXHAUSTED``, which the scheduler turns into HTTP 429 with
``Retry-After`` after trying its other nodes) when

- the queue is full (``max_waiting`` requests wait, counting those still being tokenized
  or looked up), or
- it would wait longer than ``max_queue_delay_s`` for a seat: the requests ahead of it
  divided by the rate the queue drained at while it was backlogged (seats freed by
  finished requests, or the per-step token budget, whichever binds; measured only while
  requests waited, so that a lightly loaded engine's low arrival rate is not mistaken
  for its capacity), or
- the request that has waited longest has already waited longer than that (the backstop
  while no drain rate is known yet).

Measured rather than tuned, the bound adapts to the model, the cores and the prompt
lengths, and the requests taken keep a time to first token near the bound plus one step.
"""

from __future__ import annotations

from collections import deque

from .errors import RESOURCE_EXHAUSTED, EngineError

RATE_WINDOW_S = 5.0  # the drain rate covers about this much backlogged time
RATE_MEMORY_S = 10.0  # ... within this much wall time: an engine idle since forgets it


class Admission:
    def __init__(self, max_waiting: int, max_queue_delay_s: float) -> None:
        self.max_waiting = max_waiting
        self.max_queue_delay_s = max_queue_delay_s  # 0: only the count bounds the queue
        self._last: tuple[float, int, int] | None = None  # (time, admitted, waiting)
        # Backlogged intervals: (when it ended, its length, admissions in it).
        self._busy: deque[tuple[float, float, int]] = deque()
        self._busy_s = 0.0
        self.entering = 0  # requests past the check that have not reached the queue yet

    def enter(self) -> Entering:
        """Count a request that passed ``check`` as queued until it reaches the engine's
        queue (while it is tokenized and looked up), so a burst cannot slip past."""
        return Entering(self)

    def observe(self, now: float, admitted: int, waiting: int) -> None:
        """Record the engine's admission counter and queue length (after each step)."""
        last = self._last
        self._last = (now, admitted, waiting)
        if last is None or admitted < last[1]:
            # (a new core, as after a restart, counts from zero again)
            self._busy.clear()
            self._busy_s = 0.0
            return
        t0, admitted0, waiting0 = last
        if waiting0 > 0 and now > t0:  # requests waited throughout: the queue drained at
            self._busy.append((now, now - t0, admitted - admitted0))  # the engine's pace
            self._busy_s += now - t0
            while len(self._busy) > 1 and self._busy_s - self._busy[0][1] >= RATE_WINDOW_S:
                self._busy_s -= self._busy.popleft()[1]

    def drain_rate(self, now: float | None = None) -> float:
        """Sequences admitted per second while requests waited lately (0.0: not measured,
        or not within ``RATE_MEMORY_S`` of ``now``: an idle engine takes a burst faster
        than a saturated one did)."""
        while self._busy and now is not None and now - self._busy[0][0] > RATE_MEMORY_S:
            self._busy_s -= self._busy.popleft()[1]
        if not self._busy or self._busy_s <= 0:
            self._busy_s = 0.0
            return 0.0
        return sum(n for _, _, n in self._busy) / self._busy_s

    def check(self, queued: int, oldest_waiting_since: float, now: float,
              bound_delay: bool = True) -> None:
        """Raise EngineError(RESOURCE_EXHAUSTED) when a new request must be refused.

        ``queued``: requests ahead of it (waiting in the core's queue or about to enter
        it); ``oldest_waiting_since``: ``time.monotonic()`` the longest-waiting one queued
        (0.0: the core's queue is empty). Free seats do not count against the queue:
        under load the per-step token budget, not the seats, is what holds newcomers
        back (admitting more for the free seats made every step, and so every first
        token, slower). ``bound_delay=False``: the node's deadline queue already chose
        when the request starts (it serves late requests after the others, §6.3), so
        only a full queue refuses it."""
        if queued >= self.max_waiting:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"the engine queue is full ({self.max_waiting} waiting); retry later",
            )
        bound = self.max_queue_delay_s
        if not bound or not queued or not bound_delay:
            return
        rate = self.drain_rate(now)
        if rate > 0 and (queued + 1) / rate > bound:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"the engine is behind ({queued} queued, taken at {rate:.1f}/s: a new "
                f"request would wait over {bound:g}s); retry later",
            )
        waited = now - oldest_waiting_since if oldest_waiting_since else 0.0
        if waited > bound:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"the engine is behind (its oldest queued request has waited "
                f"{waited:.1f}s, over {bound:g}s); retry later",
            )


class Entering:
    """A request past admission on its way to the engine's queue (see ``enter``)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.inside = True
        admission.entering += 1

    def leave(self) -> None:
        """It reached the queue, or ended before (idempotent)."""
        if self.inside:
            self.inside = False
            self.admission.entering -= 1
