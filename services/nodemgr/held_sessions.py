"""The sessions whose KV this node saved: what the scheduler needs to rebuild its session
directory when it restarts.

The scheduler learns where each session's KV is from the turns it routes and from the
saves the nodes report in their heartbeats (``scheduler/cluster/sessions.py``); all of it
lives in its memory. A restarted scheduler would route the next turn of every
conversation blind, and the node it picks could not pull the KV from the peer that holds
it. So the node manager keeps, per (tenant, session), the newest save its engines
reported here and sends the list with every registration; the scheduler takes the
freshest report per session across nodes (by the age sent along). Bounded: the least
recently saved sessions go first past ``capacity``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shared.proto import common_pb2
from shared.session_key import SessionKey


@dataclass(frozen=True)
class HeldSession:
    tenant: str
    session_id: str
    tokens: int
    age_s: float  # how long ago the node saved it


class HeldSessions:
    """Event-loop only."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self._clock = clock
        self._saved: OrderedDict[SessionKey, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._saved)

    def record(self, saves: Iterable[common_pb2.SessionSaved]) -> None:
        """The engines saved these (as their Status reports them)."""
        now = self._clock()
        for s in saves:
            if not s.session_id:
                continue
            key = SessionKey(s.tenant, s.session_id)
            self._saved.pop(key, None)
            self._saved[key] = (int(s.tokens), now)
        while len(self._saved) > self.capacity:
            self._saved.popitem(last=False)

    def held(self) -> list[HeldSession]:
        """Every session saved here, the most recent last."""
        now = self._clock()
        return [HeldSession(k.tenant, k.session_id, tokens, max(0.0, now - at))
                for k, (tokens, at) in self._saved.items()]
