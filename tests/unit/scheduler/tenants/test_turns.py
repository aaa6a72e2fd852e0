"""Issue 43, finding 10: refused requests are admitted in their turn. Under a sustained
overload (seats always taken, fresh requests arriving whenever one frees) every client
that keeps retrying is admitted within a bounded number of retries; without the line,
the fresh arrivals take every freed seat and the retrying clients starve."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import grpc
import pytest

from services.scheduler.api import ApiError
from services.scheduler.tenants import TOKEN_HEADER, TenantLimits, Turns
from tests.unit.scheduler.conftest import Clock, call, make_cluster
from tests.unit.scheduler.fake_engine import FakeEngine

SEATS = 4
SERVICE_S = 3  # a request holds its seat this many rounds (one round: 1 s)
CLIENTS = 12
FRESH_PER_ROUND = 6  # requests that never retry, arriving just as seats free


@dataclass
class Overload:
    """Seats of a cluster, and the requests on them (``(ends_at, tenant, waiter)``)."""

    turns: Turns | None
    clock: Clock
    seated: list[tuple[float, str, object]] = field(default_factory=list)

    def attempt(self, tenant: str, key: str) -> bool:
        """One request: whether it got a seat (False: a 429)."""
        waiter = None
        if self.turns is not None:
            try:
                waiter = self.turns.begin(tenant, key)
            except ApiError as e:
                assert e.status == 429 and e.code == "not_your_turn"
                assert e.headers["Retry-After"] == "1" and e.headers.get(TOKEN_HEADER)
                return False
        if len(self.seated) < SEATS:
            self.seated.append((self.clock.now + SERVICE_S, tenant, waiter))
            return True
        if self.turns is not None:
            self.turns.refused(tenant, key, waiter)  # (as a node's 429 would)
        return False

    def finish_due(self) -> None:
        for item in [s for s in self.seated if s[0] <= self.clock.now]:
            self.seated.remove(item)
            if self.turns is not None:
                self.turns.done(item[1], item[2])  # type: ignore[arg-type]


def run(turns: Turns | None, clock: Clock, rounds: int = 120) -> dict[str, int | None]:
    """Retries each retrying client needed (None: never admitted)."""
    rng = random.Random(7)
    world = Overload(turns, clock)
    retries: dict[str, int | None] = {f"user{i}": None for i in range(CLIENTS)}
    tries = dict.fromkeys(retries, 0)
    for r in range(rounds):
        clock.now += 1.0
        world.finish_due()
        for j in range(FRESH_PER_ROUND):  # they come first: the worst case for a retry
            world.attempt("acme", "" if j % 2 else f"fresh-{r}-{j}")
        order = [c for c in retries if retries[c] is None]
        rng.shuffle(order)
        for client in order:
            if world.attempt("acme", client):
                retries[client] = tries[client]
            else:
                tries[client] += 1
    return retries


def test_every_retrying_client_is_admitted_within_a_bounded_number_of_retries() -> None:
    clock = Clock()
    retries = run(Turns(retry_after_s=1, clock=clock), clock)
    assert all(n is not None for n in retries.values()), retries
    # Seats free at SEATS / SERVICE_S a second and go along the line: the last of the
    # clients is in after about CLIENTS * SERVICE_S / SEATS rounds, plus the first round
    # the fresh requests took and the one in which the line formed.
    bound = CLIENTS * SERVICE_S // SEATS + 2
    assert max(n for n in retries.values() if n is not None) <= bound, retries


def test_without_the_line_the_retrying_clients_starve() -> None:
    clock = Clock()
    retries = run(None, clock)
    assert all(n is None for n in retries.values()), retries


def test_the_line_keeps_its_order_and_passes_unused_turns_on() -> None:
    clock = Clock()
    turns = Turns(retry_after_s=1, clock=clock)
    assert turns.begin("t", "a") is None  # nobody waits: through
    assert turns.refused("t", "a", None) == "a"  # refused by the nodes: tentative
    clock.now += 0.1
    assert turns.refused("t", "", None)  # a request without a session gets a token
    clock.now += 0.1
    b = turns.begin("t", "b")  # a newcomer while nobody is live yet: through
    assert b is None and turns.refused("t", "b", b) == "b"
    clock.now += 1
    wa = turns.begin("t", "a")  # a's retry: live, the head of the line, tried
    assert wa is not None and turns.waiting("t") == 1
    assert turns.refused("t", "a", wa) == "a"  # refused again: it keeps its place
    with pytest.raises(ApiError, match="go first"):
        turns.begin("t", "fresh")  # a live waiter waits: a newcomer is refused
    with pytest.raises(ApiError):
        turns.begin("t", "b")  # b is live now, but behind a
    assert turns.waiting("t") == 2
    other = turns.begin("u", "x")  # other tenants are not held back
    turns.done("t", None)  # a seat of t frees: a turn for a (the oldest without one)
    assert turns.begin("t", "a") is wa
    wb = turns.begin("t", "b")  # while a is tried, b heads the line: it may try too
    assert wb is not None
    assert turns.refused("t", "b", wb) == "b"
    turns.done("t", wa)  # a was served and left the line; its seat's turn goes to b
    assert turns.waiting("t") == 1
    with pytest.raises(ApiError):
        turns.begin("t", "fresh")  # its retry: live now, behind b
    assert turns.begin("t", "b") is wb
    turns.done("u", other)
    turns.done("t", wb)  # b's seat: a turn for "fresh"
    wf = turns.begin("t", "fresh")
    assert wf is not None
    turns.done("t", wf)
    assert turns.waiting("t") == 0 and turns.begin("t", "new") is None
    # A waiter that stops retrying leaves the line after patience_s.
    turns.refused("t", "c", None)
    clock.now += 1
    wc = turns.begin("t", "c")
    assert wc is not None
    turns.refused("t", "c", wc)
    with pytest.raises(ApiError):
        turns.begin("t", "d")
    clock.now += turns.patience_s + 1
    assert turns.begin("t", "d") is None


def test_in_flight_limit_follows_the_clusters_seats() -> None:
    seats = [128]
    limits = TenantLimits(0, 0, 0, seats=lambda: seats[0], in_flight_per_seat=2.0)
    assert limits.in_flight_limit() == 256
    seats[0] = 64  # a node left rotation
    assert limits.in_flight_limit() == 128
    with limits.in_flight("t"):
        pass
    assert TenantLimits(0, 0, 7, seats=lambda: 64, in_flight_per_seat=2.0
                        ).in_flight_limit() == 7  # a fixed limit wins
    assert TenantLimits(0, 0, 0, seats=lambda: 64).in_flight_limit() == 0  # no limit


class SeatedEngine(FakeEngine):
    """A fake engine with ``seats``: beyond them it refuses as a real one that is behind."""

    def __init__(self, seats: int) -> None:
        super().__init__(token_delay_s=0.05)
        self.seats = seats

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        if self.running >= self.seats:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the engine is behind")
        async for chunk in super().Generate(request, context):
            yield chunk


async def test_retrying_chat_users_are_each_served_under_a_flood() -> None:
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 4}
    async with AsyncExitStack() as stack:
        # (no per-second rate limit: its 429s are another rule, and eight floods pass 200/s)
        c = await make_cluster(stack, engine=SeatedEngine(seats=2), behind_hold_s=0.0,
                               tenant_requests_per_s=0.0)
        stop = asyncio.Event()
        codes: Counter[str] = Counter()

        async def flood() -> None:  # never retries: a fresh request each time
            while not stop.is_set():
                status, body, _ = await call(c, "POST", "/v1/chat/completions", chat)
                codes[body["error"]["code"] if status == 429 else str(status)] += 1
                await asyncio.sleep(0.002)

        async def user(i: int) -> int:
            """Retries until served; how many retries that took."""
            headers = {"X-Session-Id": f"user-{i}"}
            for retries in range(100):
                status, _, got = await call(c, "POST", "/v1/chat/completions", chat, headers)
                if status == 200:
                    return retries
                assert status == 429 and got["Retry-After"]
                assert got[TOKEN_HEADER] == f"user-{i}"  # (its session names its place)
                await asyncio.sleep(0.05)
            raise AssertionError(f"user {i} was never served")

        floods = [asyncio.create_task(flood()) for _ in range(8)]
        try:
            await asyncio.sleep(0.3)  # the flood holds the seats
            retries = await asyncio.gather(*(user(i) for i in range(6)))
        finally:
            stop.set()
            await asyncio.gather(*floods)
        assert codes["not_your_turn"] > 0  # the line held the flood back for the users
        # Two seats, 0.2 s a request, six users: each is in within a few rounds of seats.
        assert max(retries) <= 60, retries
