"""Where each session's KV is: the node that served its last turn, and what it saved.

Symphony §3.2–3.3: a request can go to any node only because its state is not pinned to
one; what the scheduler needs is where the state is *now*, so the chosen node can pull it
from there. Per (tenant, session) this keeps the node of the last turn (recorded when the
turn's stream ends, with its length: the next node's peer waits for that much to be
saved) and the tokens that node reported saved (its heartbeats carry the engine's session
saves). Bounded: least recently used entries go first past ``capacity``, and entries
older than ``ttl_s`` are forgotten. After a scheduler restart it is rebuilt from the
nodes' registrations: each node reports the sessions whose KV it saved, with how long ago
(``restore``), and the freshest report of a session wins. A session nobody reports is
looked up in the serving node's own tiers and the shared S3 tier, then recomputed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from shared.session_key import SessionKey

Clock = Callable[[], float]


@dataclass
class SessionPlace:
    node_id: str
    turn_tokens: int = 0  # prompt + completion of the last turn (0: not known)
    saved_tokens: int = 0  # what the node reported saved for the session (0: nothing yet)
    updated: float = 0.0  # clock time of the last change


class SessionDirectory:
    """Event-loop only."""

    def __init__(self, capacity: int, ttl_s: float, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        self._places: OrderedDict[SessionKey, SessionPlace] = OrderedDict()

    def __len__(self) -> int:
        return len(self._places)

    def turn_served(self, tenant: str, session_id: str, node_id: str, tokens: int) -> None:
        """A turn of the session finished on ``node_id`` with ``tokens`` in all."""
        if not session_id:
            return
        key = SessionKey(tenant, session_id)
        old = self._places.pop(key, None)
        saved = old.saved_tokens if old is not None and old.node_id == node_id else 0
        self._places[key] = SessionPlace(node_id, tokens, saved, self.clock())
        self._trim()

    def saved(self, tenant: str, session_id: str, node_id: str, tokens: int) -> None:
        """``node_id`` saved ``tokens`` of the session. A report from another node than the
        one of the last turn is late news of an older turn and is ignored; an unknown
        session (a scheduler restart, or a save that beat the turn's end) is learnt."""
        if not session_id:
            return
        key = SessionKey(tenant, session_id)
        place = self._places.get(key)
        if place is None:
            self._places[key] = SessionPlace(node_id, 0, tokens, self.clock())
            self._trim()
        elif place.node_id == node_id:
            place.saved_tokens = max(place.saved_tokens, tokens)
            place.updated = self.clock()
            self._places.move_to_end(key)

    def restore(self, tenant: str, session_id: str, node_id: str, tokens: int,
                age_s: float) -> bool:
        """``node_id`` registered saying it saved ``tokens`` of the session ``age_s`` ago.
        Taken unless the directory knows something newer (a later turn, or a fresher save
        reported by another node); whether it was taken."""
        if not session_id or age_s > self.ttl_s:
            return False
        key = SessionKey(tenant, session_id)
        at = self.clock() - max(0.0, age_s)
        place = self._places.get(key)
        if place is not None and place.updated >= at:
            return False
        self._places[key] = SessionPlace(node_id, 0, tokens, at)
        self._places.move_to_end(key)
        self._trim()
        return True

    def where(self, tenant: str, session_id: str) -> SessionPlace | None:
        """The session's place, or None (unknown or expired)."""
        key = SessionKey(tenant, session_id)
        place = self._places.get(key)
        if place is None:
            return None
        if self.clock() - place.updated > self.ttl_s:
            del self._places[key]
            return None
        self._places.move_to_end(key)
        return place

    def forget_node(self, node_id: str) -> int:
        """Drop the sessions whose KV was on ``node_id`` (it left the cluster); how many."""
        gone = [k for k, p in self._places.items() if p.node_id == node_id]
        for k in gone:
            del self._places[k]
        return len(gone)

    def _trim(self) -> None:
        while len(self._places) > self.capacity:
            self._places.popitem(last=False)
        now = self.clock()
        while self._places:
            key, oldest = next(iter(self._places.items()))
            if now - oldest.updated <= self.ttl_s:
                break
            del self._places[key]
