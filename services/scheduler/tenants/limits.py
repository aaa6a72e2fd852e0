"""Per-tenant limits at the front door: requests and advisories per second (token
buckets) and generations in flight. Beyond them a tenant gets ``429`` with
``Retry-After``; other tenants are not slowed down by it.

A rate of 0 turns that limit off. Generations in flight are bounded by a fixed number, or
(``max_in_flight`` 0) by the cluster's capacity: ``in_flight_per_seat`` generations per
seat of the nodes in rotation (a tenant alone may fill the cluster and queue as much
again, no more: a fixed 512 let a thousand requests into a two-node cluster).

Tenants are remembered up to a bound (the least recently seen forgotten first), so a
flood of API keys cannot grow this.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from services.scheduler.api import ApiError

Clock = Callable[[], float]
MAX_TENANTS = 100_000


@dataclass
class _Bucket:
    tokens: float
    refilled: float


class TokenBuckets:
    """One bucket a tenant: ``rate`` tokens a second, at most ``burst``."""

    def __init__(self, rate: float, burst: float, clock: Clock = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, max(1.0, burst), clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(self, tenant: str) -> int | None:
        """None: allowed (a token taken); else the whole seconds until one is there."""
        if self.rate <= 0:
            return None
        now = self.clock()
        b = self._buckets.pop(tenant, None) or _Bucket(self.burst, now)
        self._buckets[tenant] = b  # (most recently seen last)
        while len(self._buckets) > MAX_TENANTS:
            self._buckets.popitem(last=False)
        b.tokens = min(self.burst, b.tokens + (now - b.refilled) * self.rate)
        b.refilled = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - b.tokens) / self.rate))


class TenantLimits:
    def __init__(self, requests_per_s: float, advisories_per_s: float, max_in_flight: int,
                 clock: Clock = time.monotonic, seats: Callable[[], int] = lambda: 0,
                 in_flight_per_seat: float = 0.0) -> None:
        """``seats``: the seats of the nodes in rotation now (for ``max_in_flight`` 0)."""
        # A burst of two seconds' worth: a client's short spikes pass.
        self.requests = TokenBuckets(requests_per_s, 2 * requests_per_s, clock)
        self.advisories = TokenBuckets(advisories_per_s, 2 * advisories_per_s, clock)
        self.max_in_flight = max_in_flight
        self._seats = seats
        self.in_flight_per_seat = in_flight_per_seat
        self._in_flight: dict[str, int] = {}

    def request(self, tenant: str) -> None:
        _refuse(self.requests.take(tenant), "requests per second", "rate_limit_exceeded")

    def advisory(self, tenant: str) -> None:
        _refuse(self.advisories.take(tenant), "advisories per second", "rate_limit_exceeded")

    def in_flight_limit(self) -> int:
        """Generations one tenant may have in flight now (0: no limit)."""
        if self.max_in_flight:
            return self.max_in_flight
        if self.in_flight_per_seat <= 0:
            return 0
        return max(1, math.ceil(self.in_flight_per_seat * self._seats()))

    @contextmanager
    def in_flight(self, tenant: str) -> Iterator[None]:
        """Bracket one generation; 429 when the tenant already has its maximum running."""
        n = self._in_flight.get(tenant, 0)
        limit = self.in_flight_limit()
        if limit and n >= limit:
            raise ApiError(429, f"this API key's tenant has {n} requests in flight, the "
                           "most allowed (scheduler.tenant_max_in_flight, or "
                           "tenant_in_flight_per_seat of the cluster's seats)",
                           code="too_many_requests_in_flight", headers={"Retry-After": "1"})
        self._in_flight[tenant] = n + 1
        try:
            yield
        finally:
            left = self._in_flight[tenant] - 1
            if left:
                self._in_flight[tenant] = left
            else:
                del self._in_flight[tenant]


def _refuse(retry_after: int | None, what: str, code: str) -> None:
    if retry_after is not None:
        raise ApiError(429, f"this API key's tenant sends more {what} than allowed; retry "
                       f"in {retry_after} s", code=code,
                       headers={"Retry-After": str(retry_after)})
