"""Back-pressure: refuse a new request the engine cannot start within its queue limit.

An engine that queues everything it is sent turns overload into collapse: every request
waits behind the whole backlog and all of them miss their deadline. Instead a request is
refused at once (``RESOURCE_EXHAUSTED``, which the scheduler turns into HTTP 429 with
``Retry-After`` after trying its other nodes) when

- the queue is full (``max_waiting`` requests wait, counting those still being tokenized
  or looked up), or
- its predicted wait for a first step is over ``max_queue_delay_s``: the prompt tokens
  ahead of it and the seats it waits for, priced at the step costs the core measured
  (``wait_forecast.py``), or
- a request ahead of it has already waited longer than that (in the core's queue or on
  its way there: the backstop while the costs are not measured yet, or are off).

The limit runs from the request's arrival in the scheduler, not in the engine: the time it
already spent on its way (``waited_s``: the scheduler's routing and its tries of nodes that
refused it, the nodemgr, each hop adding its own) is taken off what is left for the queue,
whenever it would queue at all (one that starts at once is taken however late).
Under overload the hops themselves lag (a loaded scheduler and node share the cores the
engine computes on), and a forecast that counted only the engine's queue admitted requests
whose first token came several times the limit after the client sent them.

The forecast is made where the queue is, from what the engine measures itself, so the
requests it takes start within the limit whatever the model, the cores or the prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .errors import RESOURCE_EXHAUSTED, EngineError
from .wait_forecast import QueueShape, predicted_wait


class Admission:
    def __init__(self, max_waiting: int, max_queue_delay_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_waiting = max_waiting
        self.max_queue_delay_s = max_queue_delay_s  # 0: only the count bounds the queue
        self._clock = clock
        self._entering: dict[Entering, None] = {}  # in arrival order
        self.entering_tokens = 0  # their prompts' estimated tokens

    @property
    def entering(self) -> int:
        """Requests past the check that have not reached the engine's queue yet."""
        return len(self._entering)

    def enter(self, prompt_tokens: int = 0) -> Entering:
        """Count a request that passed ``check`` as queued until it reaches the engine's
        queue (while it is tokenized and looked up), so a burst cannot slip past."""
        return Entering(self, max(0, prompt_tokens), self._clock())

    def oldest_entering_since(self) -> float:
        """When the longest-entering request arrived (0.0: none)."""
        return next(iter(self._entering)).since if self._entering else 0.0

    def check(self, queued: int, oldest_waiting_since: float, now: float,
              bound_delay: bool = True, shape: QueueShape | None = None,
              waited_s: float = 0.0, submitted_tokens: int = 0,
              step_left_s: float = 0.0) -> None:
        """Raise EngineError(RESOURCE_EXHAUSTED) when a new request must be refused.

        ``queued``: requests ahead of it (waiting in the core's queue or about to enter
        it); ``oldest_waiting_since``: ``time.monotonic()`` the longest-waiting one queued
        (0.0: the core's queue is empty); ``shape``: the core's queue after its last step
        (None: not known yet); ``waited_s``: how long the request waited before it got
        here (the limit's remainder is the queue's); ``submitted_tokens``: the prompt
        tokens of the requests submitted to the core since ``shape`` was taken;
        ``step_left_s``: what the step under way still needs (a request that queues
        waits for it first). ``bound_delay=False``: the node's deadline queue already
        chose when the request starts (it serves late requests after the others, §6.3),
        so only a full queue refuses it."""
        if queued >= self.max_waiting:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"the engine queue is full ({self.max_waiting} waiting); retry later",
            )
        bound = self.max_queue_delay_s
        if not bound or not bound_delay:
            return
        waited_s = max(0.0, waited_s)
        if shape is not None:
            # The core's queue is in ``shape``; what was submitted since (the worker's
            # inbox) and what is still entering come on top, at their own prompts' tokens
            # (priced at none, a burst within one step was forecast to wait for nothing).
            extra = max(0, queued - shape.waiting)
            wait = predicted_wait(shape, extra, self.entering_tokens + submitted_tokens)
            if wait > 0:  # (queued behind others, it starts after the step under way too)
                wait += max(0.0, step_left_s)
            # A late request that would start at once is taken all the same: it makes no
            # one wait, and refused it would only come back later still (a busy machine's
            # hops alone can take the limit).
            if wait > bound or (wait > 0 and waited_s + wait > bound):
                before = f" after {waited_s:.2f}s on its way" if waited_s else ""
                raise EngineError(
                    RESOURCE_EXHAUSTED,
                    f"the engine is behind (a new request would wait about {wait:.2f}s "
                    f"for its first step{before}, over the limit of {bound:g}s); "
                    "retry later",
                )
        oldest = min((t for t in (oldest_waiting_since, self.oldest_entering_since()) if t),
                     default=0.0)
        waited = now - oldest if oldest else 0.0
        if waited > bound:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"the engine is behind (its oldest queued request has waited "
                f"{waited:.1f}s, over {bound:g}s); retry later",
            )

class Entering:
    """A request past admission on its way to the engine's queue (see ``enter``)."""

    def __init__(self, admission: Admission, tokens: int, since: float) -> None:
        self.admission = admission
        self.tokens = tokens
        self.since = since
        self.inside = True
        admission._entering[self] = None
        admission.entering_tokens += tokens

    def leave(self) -> None:
        """It reached the queue, or ended before (idempotent)."""
        if self.inside:
            self.inside = False
            del self.admission._entering[self]
            self.admission.entering_tokens -= self.tokens
