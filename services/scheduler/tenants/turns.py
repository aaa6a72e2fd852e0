"""Refusals in turn: under overload a client that keeps retrying is admitted in its turn.

Without it, whoever asks at the moment a seat frees gets it: a client whose retries keep
landing just after someone else's arrival is refused on every retry while the others are
served (one chat user out of eight refused for a minute, issue 43). Here a tenant's
refused requests wait in a line, oldest first, and the seats its finished requests free
are handed out along that line:

    refused (429)        ─► tentative   remembered by key, with when it was first refused
    retried with the key ─► live        in the line, ordered by that first refusal
    a request of the tenant ends        ─► a turn for the oldest live waiter without one
    the head of the line, or a waiter holding a turn ─► tried on the nodes
    anyone else, while live waiters wait ─► 429 at once ("not_your_turn")

A request's key is its session (``X-Session-Id`` or ``session_id``)
or, for one without, the retry token its 429 carried (``X-Overture-Retry-Token``, to be
sent back with the retry). A client that never retries stays tentative and slows nobody
down. A turn not taken within ``turn_s`` passes to the next waiter; a waiter not seen for
``patience_s`` has given up and leaves the line. A turn goes to the waiter itself, so
the head of the line is admitted at its first retry after a seat of its tenant frees:
every retrying client is admitted within a bounded number of retries. When the tenant
has no one waiting, a freed seat goes to the oldest waiter of another tenant.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.scheduler.api import ApiError

Clock = Callable[[], float]
MAX_TENTATIVE = 10_000  # remembered refusals per tenant (more: no token, not tracked)
TOKEN_HEADER = "X-Overture-Retry-Token"


@dataclass(eq=False)
class _Waiter:
    key: str
    since: float  # first refused
    seen: float  # last attempt
    turn_until: float = 0.0  # holds a turn until then (0.0: none)
    trying: bool = False  # an attempt is on the nodes now


@dataclass
class _Line:
    """One tenant's refused requests."""

    tentative: dict[str, float] = field(default_factory=dict)  # key -> since, oldest first
    live: list[_Waiter] = field(default_factory=list)  # ordered by since

    def waiter(self, key: str) -> _Waiter | None:
        return next((w for w in self.live if w.key == key), None)


class Turns:
    def __init__(self, retry_after_s: int, clock: Clock = time.monotonic) -> None:
        self.retry_after_s = retry_after_s
        self.turn_s = retry_after_s + 2.0  # a turn waits this long for its waiter's retry
        self.patience_s = 2 * retry_after_s + 5.0  # unseen this long: the waiter gave up
        self._clock = clock
        self._lines: dict[str, _Line] = {}

    @contextmanager
    def attempt(self, tenant: str, key: str) -> Iterator[None]:
        """Bracket one request: ``begin`` (429 when it is not its turn), then ``refused``
        if a 429 ends it (its retry token added to the 429), else ``done``."""
        waiter = self.begin(tenant, key)
        try:
            yield
        except ApiError as e:
            if e.status != 429:
                self.done(tenant, waiter)
                raise
            token = self.refused(tenant, key, waiter)
            if token:
                e.headers = {**e.headers, TOKEN_HEADER: token}
            raise
        except BaseException:
            self.done(tenant, waiter)
            raise
        self.done(tenant, waiter)

    def begin(self, tenant: str, key: str) -> _Waiter | None:
        """Before a request is tried on the nodes: 429 when older refused requests of its
        tenant wait and it holds no turn. Its waiter if it is in the line (to pass to
        ``refused`` or ``done``)."""
        now = self._clock()
        line = self._lines.get(tenant)
        if line is None:
            return None
        self._expire(line, now)
        w = line.waiter(key) if key else None
        if w is None and key in line.tentative:  # a retry: it joins the line, in its place
            w = _Waiter(key, line.tentative.pop(key), now)
            at = next((i for i, o in enumerate(line.live) if o.since > w.since), None)
            line.live.insert(len(line.live) if at is None else at, w)
        if w is not None:
            w.seen = now
            head = next((o for o in line.live if not o.trying), None)
            if w.turn_until > now or w is head:
                w.turn_until, w.trying = 0.0, True
                return w
        if not any(not o.trying for o in line.live):
            self._forget_empty(tenant, line)
            return w
        if w is None:  # it takes its place at the end of the line, under a token if need be
            key = key or uuid.uuid4().hex
            if len(line.tentative) < MAX_TENTATIVE:
                line.tentative.setdefault(key, now)
            elif key not in line.tentative:
                key = ""
        raise ApiError(429, "older refused requests of this API key's tenant are waiting "
                       "for a free seat and go first; retry after "
                       f"{self.retry_after_s}s", code="not_your_turn",
                       headers={"Retry-After": str(self.retry_after_s),
                                **({TOKEN_HEADER: key} if key else {})})

    def refused(self, tenant: str, key: str, waiter: _Waiter | None) -> str:
        """The nodes (or a limit) refused the request: it keeps its place, or takes one at
        the end of the line. The key the client should send back ("" if none)."""
        now = self._clock()
        line = self._lines.setdefault(tenant, _Line())
        if waiter is not None and waiter in line.live:
            waiter.trying = False
            return waiter.key
        key = key or uuid.uuid4().hex
        if len(line.tentative) >= MAX_TENTATIVE and key not in line.tentative:
            return ""
        line.tentative.setdefault(key, now)
        return key

    def done(self, tenant: str, waiter: _Waiter | None) -> None:
        """A request that was let through ended (served, or failed otherwise than by a
        429): its seat is free again, and goes to the next in line."""
        line = self._lines.get(tenant)
        if waiter is not None and line is not None and waiter in line.live:
            line.live.remove(waiter)
        now = self._clock()
        for name in (tenant, *self._lines):  # its own line first, then any other
            other = self._lines.get(name)
            if other is not None and self._grant(other, now):
                return

    def waiting(self, tenant: str) -> int:
        """Live waiters of ``tenant``."""
        line = self._lines.get(tenant)
        return len(line.live) if line is not None else 0

    def _grant(self, line: _Line, now: float) -> bool:
        """A turn for the oldest live waiter without one; whether there was one."""
        for w in line.live:
            if not w.trying and w.turn_until <= now:
                w.turn_until = now + self.turn_s
                return True
        return False

    def _expire(self, line: _Line, now: float) -> None:
        gone = now - self.patience_s
        while line.tentative:
            key, since = next(iter(line.tentative.items()))
            if since >= gone:
                break
            del line.tentative[key]
        line.live = [w for w in line.live if w.trying or w.seen >= gone]

    def _forget_empty(self, tenant: str, line: _Line) -> None:
        if not line.tentative and not line.live:
            del self._lines[tenant]
