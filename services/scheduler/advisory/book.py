"""Pending advisories: a request announced before it is sent (Symphony §3.3, §3.6).

An advisory says "session S of model M will send its next turn soon": the scheduler picks
the node for that turn now, tells it to move the session's KV into place, and records the
choice here so that the request, when it comes, goes where its KV is being prepared. Per
(tenant, session) one advisory is pending at a time (a newer one replaces it). An
advisory ends one of four ways, each counted: *followed* (its request arrived), *expired*
(no request within ``ttl_s`` after the expected arrival: spurious), *invalidated*
(``DELETE /v1/advisory/{id}``) or *replaced*. Event-loop only; expiry is computed from the
injectable clock when asked, and ``sweep()`` reports the ones that lapsed.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from shared.session_key import SessionKey

Clock = Callable[[], float]
FOLLOWED, EXPIRED, INVALIDATED, REPLACED = "followed", "expired", "invalidated", "replaced"
LATE = "late"  # its request came after it lapsed: not followed, but not spurious either
CLIENT, INFERRED = "client", "inferred"  # who made an advisory (``inferred.py``)


class TooManyAdvisories(Exception):
    """The tenant already has its share of pending advisories."""


@dataclass
class Advisory:
    advisory_id: str
    tenant: str
    session_id: str
    model: str
    node_id: str
    priority: int
    created: float  # clock time
    expires_at: float  # clock time: created + expected arrival + ttl
    wall_expires_at: float  # the same, as Unix time (what the client is told)
    prefetch: bool = True  # its node prefetches for it (its plan's): told when it ends
    source: str = CLIENT  # CLIENT or INFERRED (the scheduler's own, from a tool-call turn)
    tools: tuple[str, ...] = ()  # an inferred one's: the functions its session's turn called


def new_advisory_id() -> str:
    return "adv-" + secrets.token_hex(12)


class AdvisoryBook:
    def __init__(self, ttl_s: float, capacity: int, clock: Clock = time.monotonic,
                 per_tenant: int | None = None) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        # One tenant cannot crowd out the others (None: no limit but ``capacity``).
        self.per_tenant = per_tenant if per_tenant is not None else sys.maxsize
        self.clock = clock
        self._by_id: OrderedDict[str, Advisory] = OrderedDict()  # oldest first
        self._by_session: dict[SessionKey, str] = {}
        self._pending: dict[str, int] = {}  # per tenant

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, tenant: str, session_id: str, model: str, node_id: str, priority: int,
            expected_arrival_s: float, prefetch: bool = True, source: str = CLIENT,
            tools: tuple[str, ...] = (), life_s: float = 0.0
            ) -> tuple[Advisory, list[tuple[Advisory, str]]]:
        """Record a new advisory; also returns the ones it ended (replaced, or the tenant's
        own oldest past ``capacity``: counted as expired), with how they ended. Raises
        ``TooManyAdvisories`` when the tenant already has ``per_tenant`` pending.
        ``life_s`` > 0 sets its expiry from now (else expected arrival + ``ttl_s``)."""
        now = self.clock()
        replacing = self._by_session.get(SessionKey(tenant, session_id)) is not None
        if self._pending.get(tenant, 0) >= self.per_tenant and not replacing:
            raise TooManyAdvisories(tenant)
        life = life_s if life_s > 0 else expected_arrival_s + self.ttl_s
        adv = Advisory(new_advisory_id(), tenant, session_id, model, node_id, priority,
                       created=now, expires_at=now + life, wall_expires_at=time.time() + life,
                       prefetch=prefetch, source=source, tools=tools)
        ended: list[tuple[Advisory, str]] = []
        old_id = self._by_session.get(SessionKey(tenant, session_id))
        if old_id is not None:
            ended.append((self._remove(old_id), REPLACED))
        while len(self._by_id) >= self.capacity:  # the tenant's own oldest first
            victim = next((a for a in self._by_id.values() if a.tenant == tenant),
                          next(iter(self._by_id.values())))
            ended.append((self._remove(victim.advisory_id), EXPIRED))
        self._by_id[adv.advisory_id] = adv
        self._by_session[SessionKey(tenant, session_id)] = adv.advisory_id
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        return adv, ended

    def pending(self, tenant: str) -> int:
        return self._pending.get(tenant, 0)

    def get(self, tenant: str, advisory_id: str) -> Advisory | None:
        """The tenant's pending advisory of that id (another tenant's is not found)."""
        adv = self._by_id.get(advisory_id)
        if adv is None or adv.tenant != tenant or adv.expires_at < self.clock():
            return None
        return adv

    def pending_for(self, tenant: str, session_id: str) -> Advisory | None:
        """The session's pending advisory, if still in time (it stays pending)."""
        advisory_id = self._by_session.get(SessionKey(tenant, session_id))
        return self.get(tenant, advisory_id) if advisory_id is not None else None

    def invalidate(self, tenant: str, advisory_id: str) -> Advisory | None:
        adv = self.get(tenant, advisory_id)
        if adv is not None:
            self._remove(advisory_id)
        return adv

    def follow(self, tenant: str, session_id: str) -> tuple[Advisory | None, str]:
        """The session's pending advisory, ended: (it, FOLLOWED) when its request came in
        time, (it, LATE) when after it lapsed (not yet swept), (None, "") without one."""
        advisory_id = self._by_session.get(SessionKey(tenant, session_id))
        if advisory_id is None:
            return None, ""
        adv = self._remove(advisory_id)
        return adv, (FOLLOWED if adv.expires_at >= self.clock() else LATE)

    def sweep(self) -> list[Advisory]:
        """End and return the advisories whose time ran out (spurious ones)."""
        now = self.clock()
        lapsed = [a for a in self._by_id.values() if a.expires_at < now]
        for a in lapsed:
            self._remove(a.advisory_id)
        return lapsed

    def _remove(self, advisory_id: str) -> Advisory:
        adv = self._by_id.pop(advisory_id)
        left = self._pending.get(adv.tenant, 1) - 1
        if left:
            self._pending[adv.tenant] = left
        else:
            self._pending.pop(adv.tenant, None)
        key = SessionKey(adv.tenant, adv.session_id)
        if self._by_session.get(key) == advisory_id:
            del self._by_session[key]
        return adv
