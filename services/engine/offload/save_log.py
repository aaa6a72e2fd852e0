"""The sessions whose save to the node's kvstore completed, numbered, for the scheduler.

The scheduler keeps where each session's KV is (the node that served its last turn and
how many tokens it saved). The engine appends here when a session's ``SaveFromPool``
answers; the node manager reads what is newer than the last number it forwarded
(``Engine.Status(saved_after=n)``) and passes it on in its next heartbeat. Bounded: if the
node manager falls behind by more than ``capacity`` saves the oldest are lost, which only
costs the scheduler a hint (it falls back to S3, then recompute).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from shared.session_key import SessionKey


@dataclass(frozen=True)
class SavedSession:
    session: SessionKey
    tokens: int
    seq: int


class SaveLog:
    """Event-loop only."""

    def __init__(self, capacity: int = 4096) -> None:
        self._entries: deque[SavedSession] = deque(maxlen=capacity)
        # Numbers start at the clock in microseconds: a restarted engine numbers above
        # whatever its node manager acknowledged from the process before it.
        self._numbers = itertools.count(time.time_ns() // 1000)

    def record(self, session: SessionKey, tokens: int) -> None:
        self._entries.append(SavedSession(session, tokens, next(self._numbers)))

    def after(self, seq: int) -> tuple[SavedSession, ...]:
        """The entries numbered above ``seq``, oldest first."""
        return tuple(e for e in self._entries if e.seq > seq)
