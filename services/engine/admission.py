"""Back-pressure: refuse a new request while the engine cannot keep up.

An engine that queues everything it is sent turns overload into collapse: every request
waits behind the whole backlog and all of them miss their deadline. Instead a request is
refused at once (``RESOURCE_EXHAUSTED``, which the scheduler turns into HTTP 429 with
``Retry-After`` after trying its other nodes) while

- the queue is full (``max_waiting`` requests wait, counting those not yet in the core), or
- the request that has waited longest has waited more than ``max_queue_delay_s``: the
  engine is behind, and a newcomer would only miss its time-to-first-token too.

The queue delay adapts to whatever the engine's throughput is (model, cores, prompt
lengths), so the admitted requests keep a bounded wait without a tuned count.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RESOURCE_EXHAUSTED, EngineError


@dataclass(frozen=True)
class Admission:
    max_waiting: int
    max_queue_delay_s: float  # 0: only the count bounds the queue

    def check(self, queued: int, oldest_waiting_since: float, now: float) -> None:
        """Raise EngineError(RESOURCE_EXHAUSTED) when a new request must be refused.

        ``queued``: requests waiting (in the core's queue or about to enter it);
        ``oldest_waiting_since``: ``time.monotonic()`` the longest-waiting one queued (0.0:
        the core's queue is empty)."""
        if queued >= self.max_waiting:
            raise EngineError(
                RESOURCE_EXHAUSTED,
                f"the engine queue is full ({self.max_waiting} waiting); retry later",
            )
        if self.max_queue_delay_s and oldest_waiting_since:
            waited = now - oldest_waiting_since
            if waited > self.max_queue_delay_s:
                raise EngineError(
                    RESOURCE_EXHAUSTED,
                    f"the engine is behind (its oldest queued request has waited "
                    f"{waited:.1f}s, over {self.max_queue_delay_s:g}s); retry later",
                )
