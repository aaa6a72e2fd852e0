"""The nodemgr's admission queue: Algorithm 2's order across models, an engine's depth."""

from __future__ import annotations

import asyncio

import pytest

from services.nodemgr.admission import DeadlineAdmission, estimate_tokens

SLO = {"fast": 1.0, "slow": 10.0}


async def test_dispatch_follows_deadlines_and_engine_depth() -> None:
    now = [0.0]
    adm = DeadlineAdmission(depth=1, default_speed=100.0, slo=SLO.__getitem__,
                            clock=lambda: now[0])
    order: list[str] = []
    firsts: dict[str, asyncio.Event] = {}

    async def request(name: str, model: str, tokens: int) -> None:
        async with adm.slot(model, "engine0", tokens) as first_token:
            order.append(name)
            firsts[name] = asyncio.Event()
            await firsts[name].wait()
            first_token(tokens)

    r1 = asyncio.create_task(request("r1", "slow", 50))
    await asyncio.sleep(0)
    assert order == ["r1"]  # the engine was free
    r2 = asyncio.create_task(request("r2", "slow", 50))  # deadline 10
    r3 = asyncio.create_task(request("r3", "fast", 20))  # deadline 1: goes first
    await asyncio.sleep(0)
    assert order == ["r1"] and adm.waiting == 2  # depth 1: both wait
    now[0] = 0.5
    firsts["r1"].set()
    await asyncio.sleep(0.01)
    assert order == ["r1", "r3"]
    firsts["r3"].set()
    await asyncio.sleep(0.01)
    firsts["r2"].set()
    await asyncio.gather(r1, r2, r3)
    assert order == ["r1", "r3", "r2"] and adm.waiting == 0
    assert adm.speed["slow"] > 0  # measured from the requests served


async def test_a_request_that_cannot_make_it_yields_to_those_that_can() -> None:
    now = [0.0]
    adm = DeadlineAdmission(depth=1, default_speed=10.0, slo={"m": 1.0, "n": 3.0}.__getitem__,
                            clock=lambda: now[0])
    order: list[str] = []
    gate = asyncio.Event()

    async def request(name: str, model: str, tokens: int) -> None:
        async with adm.slot(model, "e", tokens) as first_token:
            order.append(name)
            await gate.wait()
            first_token(tokens)

    busy = asyncio.create_task(request("busy", "n", 1))
    await asyncio.sleep(0)
    # "long" (deadline 1, needs 2 s) cannot make it whatever happens; "short" (deadline 3,
    # 0.5 s) can: Moore-Hodgson drops "long" from the on-time schedule, it runs after.
    long = asyncio.create_task(request("long", "m", 20))
    short = asyncio.create_task(request("short", "n", 5))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(busy, long, short)
    assert order == ["busy", "short", "long"]


async def test_prefill_speed_is_measured_from_dispatch_not_arrival() -> None:
    """Time spent waiting in the node's queue is not prefill time: a request that waited 9 s
    for its turn and then prefilled 100 tokens in 1 s measures 100 tokens/s, not 10."""
    now = [0.0]
    adm = DeadlineAdmission(depth=1, default_speed=50.0, clock=lambda: now[0])
    release = asyncio.Event()

    async def holder() -> None:
        async with adm.slot("other", "e", 1) as first_token:
            await release.wait()
            first_token(0)

    async def measured() -> None:
        async with adm.slot("m", "e", 100) as first_token:
            now[0] += 1.0  # its prefill
            first_token(100)

    t1 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    t2 = asyncio.create_task(measured())
    await asyncio.sleep(0)
    now[0] = 9.0  # queued behind the holder until now
    release.set()
    await asyncio.gather(t1, t2)
    assert adm.speed["m"] == 100.0


async def test_a_cancelled_waiter_leaves_the_queue_and_is_never_dispatched() -> None:
    adm = DeadlineAdmission(depth=1)
    hold = asyncio.Event()
    firsts: list = []

    async def holder() -> None:
        async with adm.slot("m", "e", 10) as first_token:
            firsts.append(first_token)
            await hold.wait()

    t1 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    t2 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    assert adm.waiting == 1
    t2.cancel()
    await asyncio.gather(t2, return_exceptions=True)
    assert adm.waiting == 0
    # Cancelled just before its turn (its client went away): its ticket is cancelled at
    # once but it leaves the queue a loop turn later; a pump meanwhile must skip it, or
    # its engine would lose the seat for good.
    t3 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    t3.cancel()
    firsts[0](10)  # t1's first token, in the same turn: a pump
    await asyncio.gather(t3, return_exceptions=True)
    assert adm.waiting == 0 and adm._starting == {"e": 0}
    t4 = asyncio.create_task(holder())  # the seat is free for the next one
    await asyncio.sleep(0)
    assert len(firsts) == 2
    hold.set()
    await asyncio.gather(t1, t4)
    assert estimate_tokens(400, 0) == 100 and estimate_tokens(400, 7) == 7


async def test_a_waiting_stream_sends_keepalives(monkeypatch) -> None:
    """Activation and the deadline queue may hold a request for seconds: the node's stream
    sends keepalives meanwhile (the scheduler cuts a silent stream as a stopped node)."""
    from services.nodemgr import grpc_service

    monkeypatch.setattr(grpc_service, "KEEPALIVE_S", 0.02)
    task = asyncio.ensure_future(asyncio.sleep(0.15))
    chunks = [c async for c in grpc_service._until_done(task, "r1")]
    assert len(chunks) >= 4 and all(c.keepalive and c.request_id == "r1" for c in chunks)
    assert task.done() and not task.cancelled()


async def test_a_full_node_queue_refuses_and_the_queue_is_unchanged() -> None:
    from services.nodemgr.admission import NodeQueueFull

    adm = DeadlineAdmission(depth=1, max_waiting=1)
    hold = asyncio.Event()

    async def holder() -> None:
        async with adm.slot("m", "e", 10):
            await hold.wait()

    running = asyncio.create_task(holder())  # dispatched: not counted as waiting
    await asyncio.sleep(0)
    queued = asyncio.create_task(holder())
    await asyncio.sleep(0)
    assert adm.waiting == 1
    try:
        async with adm.slot("m", "e", 10):
            raise AssertionError("a request past max_waiting was queued")
    except NodeQueueFull as e:
        assert "full (1 waiting)" in str(e)
    assert adm.waiting == 1
    hold.set()
    await asyncio.gather(running, queued)
    assert adm.waiting == 0


async def test_a_late_request_is_served_after_the_others() -> None:
    """Only Algorithm 2's schedule S is dispatched while any of it waits; a request S gave
    up on goes after, one at a time into an engine with nothing else starting."""
    now = [0.0]
    adm = DeadlineAdmission(depth=1, default_speed=10.0, slo={"m": 1.0, "n": 5.0}.__getitem__,
                            clock=lambda: now[0])
    order: list[str] = []
    gates = {name: asyncio.Event() for name in ("a", "w", "late1", "late2")}

    async def request(name: str, model: str, engine: str, tokens: int) -> None:
        async with adm.slot(model, engine, tokens) as first_token:
            order.append(name)
            await gates[name].wait()
            first_token(tokens)

    a = asyncio.create_task(request("a", "n", "e1", 10))  # on time: starts on e1
    await asyncio.sleep(0)
    w = asyncio.create_task(request("w", "n", "e1", 10))  # on time, waits for e1
    # Needs 3 s of prefill against a 1 s SLO: late; e2 is free, yet it waits for w.
    late1 = asyncio.create_task(request("late1", "m", "e2", 30))
    late2 = asyncio.create_task(request("late2", "m", "e2", 30))
    await asyncio.sleep(0)
    assert order == ["a"] and adm.waiting == 3
    gates["a"].set()  # e1 takes w: nothing of S waits now
    await asyncio.sleep(0.01)
    assert order == ["a", "w", "late1"] and adm.waiting == 1  # one at a time on e2
    gates["late1"].set()
    await asyncio.sleep(0.01)
    assert order == ["a", "w", "late1", "late2"]
    for g in gates.values():
        g.set()
    await asyncio.gather(a, w, late1, late2)
    assert adm.waiting == 0 and not any(adm._starting.values())


async def test_a_request_the_node_cannot_start_in_time_is_refused() -> None:
    """Issue 43: the node's queue keeps the queue limit for the requests it dispatches
    (their engine does not bound their delay): a newcomer whose predicted wait here, the
    prefill queued ahead for its engine at the measured speed, is over it is refused."""
    from services.nodemgr.admission import NodeQueueFull

    now = [0.0]
    adm = DeadlineAdmission(depth=1, default_speed=1000.0, clock=lambda: now[0],
                            max_delay_s=0.5)
    hold = asyncio.Event()

    async def holder(engine: str, tokens: int) -> None:
        async with adm.slot("m", engine, tokens):
            await hold.wait()

    tasks = [asyncio.create_task(holder("e", 100))]  # dispatched: the engine is busy
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(holder("e", 200)) for _ in range(2)]  # 0.4 s queued
    await asyncio.sleep(0)
    assert adm.waiting == 2 and adm.predicted_wait("e", now[0]) == pytest.approx(0.4)
    tasks.append(asyncio.create_task(holder("e", 200)))  # 0.4 s ahead of it: fits
    await asyncio.sleep(0)
    assert adm.waiting == 3
    with pytest.raises(NodeQueueFull, match="would wait about 0.60s"):
        async with adm.slot("m", "e", 10):
            raise AssertionError("a request the node cannot start in time was queued")
    assert adm.waiting == 3
    tasks.append(asyncio.create_task(holder("other", 10)))  # another engine's queue
    await asyncio.sleep(0)
    now[0] = 1.0  # (and the oldest queued for "e" has waited 1 s: newcomers wait)
    assert adm.predicted_wait("e", now[0]) == 1.0
    hold.set()
    await asyncio.gather(*tasks)
    assert adm.waiting == 0 and adm.predicted_wait("e", now[0]) == 0.0
