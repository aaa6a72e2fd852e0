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
    useful: float = 1.0  # exponential average of outcomes (1 = followed)
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
        weight = 1.0 / max(1, self.min_outcomes)
        t.useful += weight * ((1.0 if followed else 0.0) - t.useful)
        t.outcomes += 1

    def throttled(self, tenant: str) -> bool:
        t = self._tenants.get(tenant)
        return (t is not None and t.outcomes >= self.min_outcomes
                and t.useful < self.min_useful)

    def retry_after(self, tenant: str) -> int | None:
        """None: the tenant may advise now (a token is taken if it is throttled); else the
        whole seconds until it may."""
        if not self.throttled(tenant):
            return None
        t = self._tenants[tenant]
        now = self.clock()
        t.tokens = min(self.burst, t.tokens + (now - t.refilled) * self.rate)
        t.refilled = now
        if t.tokens >= 1.0:
            t.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - t.tokens) / self.rate))
