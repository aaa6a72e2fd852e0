"""The scheduler's wall clock as seen from this node: how long a request took to get here.

A request's queue limit runs from its arrival in the scheduler (the engine counts what it
waited before: ``waited_ms``). Each hop adds the time it held the request, but the time
between hops is nobody's: a node whose cores are busy with its engine lets a request sit
in its connection before its handler runs, seconds under overload. The scheduler stamps
its wall clock on the request (``sent_us``); this node knows how far the scheduler's
clock is from its own from the heartbeats, as NTP does it: the scheduler stamps its acks,
and with the beat's send and the ack's receipt here

    offset = scheduler_time - (sent + received) / 2      (error at most the round trip / 2)

The sample of the shortest round trip among the last ``WINDOW`` is kept (a slow round
trip says least about the offset). Before the first ack nothing is counted (no guess).
"""

from __future__ import annotations

import time
from collections import deque

WINDOW = 16  # heartbeats whose samples are kept
MAX_TRANSIT_S = 60.0  # a longer gap is a clock gone wrong, not a wait: counted as this


class ClockOffset:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (rtt, offset)
        self.offset_s: float | None = None  # scheduler's clock minus ours (None: unknown)

    def observe(self, sent: float, received: float, remote: float) -> None:
        """A beat sent at ``sent`` (our wall clock) was acked at ``remote`` (theirs),
        the ack received at ``received`` (ours)."""
        if not remote or received < sent:
            return
        self._samples.append((received - sent, remote - (sent + received) / 2))
        self.offset_s = min(self._samples)[1]

    def transit_s(self, remote_sent: float, now: float | None = None) -> float:
        """Seconds since the scheduler sent a request at ``remote_sent`` (its clock; 0:
        not stamped): 0 when unknown, at most ``MAX_TRANSIT_S``."""
        if not remote_sent or self.offset_s is None:
            return 0.0
        now = time.time() if now is None else now
        return min(MAX_TRANSIT_S, max(0.0, now - (remote_sent - self.offset_s)))
