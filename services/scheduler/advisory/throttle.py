"""Throttle tenants whose advisories are mostly spurious (Symphony §3.6, DESIGN §6).

Every advisory that ends counts for its tenant: followed by its request (useful) or not
(expired unused; an invalidation is the client being honest, and does not count against
it). A tenant with at least ``min_outcomes`` recent outcomes whose useful share (an
exponential average over about that many) is below ``min_useful`` may still advise, but
through a token bucket of ``rate`` per second (``burst`` at most): beyond it, 429 with
``Retry-After``. A tenant whose advisories become useful again is let go.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass
class _Tenant:
    useful: float = 0.0  # exponential average of outcomes (1 = followed; seeded by the 1st)
    outcomes: int = 0
    tokens: float = 0.0
    refilled: float = 0.0


class AdvisoryThrottle:
    def __init__(self, min_useful: float, rate: float, burst: float, min_outcomes: int,
                 clock: Clock = time.monotonic, max_tenants: int = 100_000) -> None:
        self.min_useful = min_useful
        self.rate = rate
        self.burst = burst
        self.min_outcomes = min_outcomes
        self.clock = clock
        self.max_tenants = max_tenants
        self._tenants: dict[str, _Tenant] = {}

    def outcome(self, tenant: str, followed: bool) -> None:
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= self.max_tenants:
                self._tenants.pop(next(iter(self._tenants)))
            t = self._tenants[tenant] = _Tenant(tokens=self.burst, refilled=self.clock())
        value = 1.0 if followed else 0.0
        # An average over about the last min_outcomes (exact over the first ones).
        weight = 1.0 / min(t.outcomes + 1, max(1, self.min_outcomes))
        t.useful += weight * (value - t.useful)
        t.outcomes += 1

    def throttled(self, tenant: str) -> bool:
        t = self._tenants.get(tenant)
        return (t is not None and t.outcomes >= self.min_outcomes
                and t.useful < self.min_useful)

    def retry_after(self, tenant: str, count: int = 1) -> int | None:
        """None: the tenant may send ``count`` advisories now (as many tokens are taken if
        it is throttled); else the whole seconds until it may."""
        if not self.throttled(tenant):
            return None
        t = self._tenants[tenant]
        now = self.clock()
        t.tokens = min(self.burst, t.tokens + (now - t.refilled) * self.rate)
        t.refilled = now
        if t.tokens >= count:
            t.tokens -= count
            return None
        return max(1, math.ceil((count - t.tokens) / self.rate))
