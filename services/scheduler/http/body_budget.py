"""Bytes of request bodies being read, per tenant: a key holder cannot pin the scheduler's
memory with stalled uploads.

Each body reserves its announced length (or ``max_body_bytes`` when it announces none)
from its tenant's ``per_tenant`` bytes before the first byte is read, and gives it back
when the read ends, whatever the outcome. A body that could never fit is refused with
413; one that does not fit now, beside the tenant's other uploads, with 429 and
``Retry-After``. After a stalled body's 408 the connection is closed with what it
buffered, and the freed buffers are handed back to the kernel (``shared/libc.py``; at
most once a second): 500 stalled 4 MiB bodies left 2.9 GB of RSS behind without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.scheduler.api import ApiError
from shared.libc import trim_heap

TRIM_INTERVAL_S = 1.0


class BodyBudget:
    def __init__(self, per_tenant: int, max_body_bytes: int,
                 trim: Callable[[], object] = trim_heap,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_tenant = per_tenant  # 0: no limit
        self.max_body_bytes = max_body_bytes
        self._trim = trim
        self._clock = clock
        self._last_trim = float("-inf")
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """Bytes ``tenant``'s bodies being read have reserved."""
        return self._held.get(tenant, 0)

    @contextmanager
    def reading(self, tenant: str, length: int | None) -> Iterator[None]:
        """Reserve a body's bytes while it is read (413 or 429 when they do not fit)."""
        need = self.max_body_bytes if length is None else min(length, self.max_body_bytes)
        held = self._held.get(tenant, 0)
        if self.per_tenant and need > self.per_tenant:
            raise ApiError(413, f"a request body of {need} bytes is more than this API key's "
                           f"tenant may upload at once ({self.per_tenant} bytes, "
                           "scheduler.tenant_body_bytes)", code="body_too_large")
        if self.per_tenant and held + need > self.per_tenant:
            raise ApiError(429, f"this API key's tenant is uploading {held} bytes of "
                           f"request bodies already; {need} more would pass the "
                           f"{self.per_tenant} bytes allowed at once "
                           "(scheduler.tenant_body_bytes); retry after 1s",
                           code="too_many_body_bytes", headers={"Retry-After": "1"})
        self._held[tenant] = held + need
        try:
            yield
        finally:
            left = self._held[tenant] - need
            if left:
                self._held[tenant] = left
            else:
                del self._held[tenant]

    def stalled(self) -> bool:
        """A body stalled (408): give freed memory back (at most once a second); whether
        it was given back now."""
        now = self._clock()
        if now - self._last_trim < TRIM_INTERVAL_S:
            return False
        self._last_trim = now
        self._trim()
        return True
