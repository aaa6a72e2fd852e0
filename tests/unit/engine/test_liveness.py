"""Busy is not dead: Status answers while the worker is busy, quiet streams send
keepalives, and an engine that is behind refuses new requests instead of queueing them."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from services.engine.admission import Admission
from services.engine.api_types import SamplingParams
from services.engine.errors import EngineError
from services.engine.model import LoadedModel
from services.engine.server import EngineServicer
from services.engine.validation import PreparedRequest
from services.engine.wait_forecast import QueueShape, StepCost, predicted_wait
from services.engine.worker import Worker
from services.engine.worker.commands import Abort, Add
from shared.proto import common_pb2
from tests.unit.engine.engine_helpers import (
    PROMPTS,
    engine,
    greedy,
    idle,
)


def test_admission_refuses_a_full_or_late_queue() -> None:
    a = Admission(max_waiting=3, max_queue_delay_s=1.0)
    a.check(2, 0.0, 100.0)  # room, nothing waits
    a.check(2, 99.5, 100.0)  # the oldest has waited 0.5 s
    with pytest.raises(EngineError, match="queue is full") as e:
        a.check(3, 0.0, 100.0)
    assert e.value.code == "resource_exhausted"
    with pytest.raises(EngineError, match="behind"):
        a.check(1, 98.0, 100.0)
    Admission(max_waiting=3, max_queue_delay_s=0.0).check(1, 1.0, 100.0)  # delay bound off
    a.check(1, 98.0, 100.0, bound_delay=False)  # the node's queue chose to start it now
    with pytest.raises(EngineError, match="queue is full"):
        a.check(3, 98.0, 100.0, bound_delay=False)


def test_admission_refuses_a_request_whose_predicted_wait_is_over_the_limit() -> None:
    a = Admission(max_waiting=100, max_queue_delay_s=1.0)
    # 2 queued, 1000 prompt tokens ahead at 1 ms each: 1 s of prefill plus 4 steps of
    # 10 ms (256 of the 512-token budget go to prefill beside 256 decodes).
    shape = QueueShape(waiting=2, prefill_tokens=1000, running=256, seats=512,
                       token_budget=512, decode_left=(5,) * 256, decode_step_s=0.01,
                       prefill_s_per_token=0.001)
    assert predicted_wait(shape) == pytest.approx(1.04)
    with pytest.raises(EngineError, match="wait about 1.04s") as e:
        a.check(2, 99.9, 100.0, shape=shape)
    assert e.value.code == "resource_exhausted"
    a.check(2, 99.9, 100.0, shape=dataclasses.replace(shape, prefill_tokens=500))
    # Seats: 2 free, 3 queued ahead: the 2nd running one to finish (9 steps) frees its.
    seats = QueueShape(waiting=3, running=4, seats=6, token_budget=512,
                       decode_left=(3, 9, 40, 200), decode_step_s=0.1)
    assert predicted_wait(seats) == pytest.approx(0.9)
    a.check(3, 99.9, 100.0, shape=seats)
    with pytest.raises(EngineError, match="behind"):
        a.check(4, 99.9, 100.0, shape=dataclasses.replace(seats, waiting=4))  # 40 steps
    # Unmeasured costs predict nothing: only the age of the queue's head bounds it.
    a.check(50, 99.5, 100.0, shape=QueueShape(waiting=50, prefill_tokens=10**6))


def test_requests_on_their_way_to_the_queue_count_in_the_forecast() -> None:
    now = [100.0]
    a = Admission(max_waiting=100, max_queue_delay_s=1.0, clock=lambda: now[0])
    shape = QueueShape(seats=64, token_budget=512, prefill_s_per_token=0.001)
    entries = [a.enter(400) for _ in range(2)]  # 800 tokens being tokenized
    a.check(2, 0.0, 100.0, shape=shape)  # 0.8 s
    third = a.enter(400)
    with pytest.raises(EngineError, match="behind"):
        a.check(3, 0.0, 100.0, shape=shape)  # 1.2 s
    third.leave()
    third.leave()  # (idempotent)
    assert (a.entering, a.entering_tokens) == (2, 800)
    now[0] = 102.0  # the oldest entering one has waited 2 s: newcomers wait
    with pytest.raises(EngineError, match="has waited 2.0s"):
        a.check(2, 0.0, 102.0, shape=QueueShape(seats=64, token_budget=512))
    for e in entries:
        e.leave()
    a.check(0, 0.0, 102.0, shape=shape)


def test_requests_submitted_since_the_last_step_count_at_their_tokens() -> None:
    # Requests past planning wait in the worker's inbox until the next step takes them in:
    # the last step's queue does not show them. Priced at no tokens, a burst that came
    # within one step was forecast to wait for nothing, and its later requests waited
    # seconds past the limit (bench.cluster.admission, small model: p99 9.75x the limit).
    a = Admission(max_waiting=100, max_queue_delay_s=1.0)
    shape = QueueShape(running=2, seats=64, token_budget=512, prefill_s_per_token=0.001)
    a.check(3, 0.0, 100.0, shape=shape, submitted_tokens=600)  # 0.6 s of prefill ahead
    with pytest.raises(EngineError, match="would wait about 1.50s"):
        a.check(3, 0.0, 100.0, shape=shape, submitted_tokens=1500)
    entering = a.enter(500)  # and one still being tokenized on top
    with pytest.raises(EngineError, match="would wait about 1.10s"):
        a.check(4, 0.0, 100.0, shape=shape, submitted_tokens=600)
    entering.leave()
    # Queued behind others, it waits for the step under way first; alone, it starts next.
    a.check(3, 0.0, 100.0, shape=shape, submitted_tokens=900, step_left_s=0.1)
    with pytest.raises(EngineError, match="would wait about 1.05s"):
        a.check(3, 0.0, 100.0, shape=shape, submitted_tokens=900, step_left_s=0.15)
    a.check(0, 0.0, 100.0, shape=shape, step_left_s=5.0)


def test_the_worker_prices_its_inbox_until_a_step_takes_it_in() -> None:
    class Sink:
        def dispatch(self, events: list) -> None:
            pass

    w = Worker(Sink())
    w.submit(Add(PreparedRequest("a", [1] * 300, SamplingParams(), 4, b"", 0)), 300)
    w.submit(Add(PreparedRequest("b", [1] * 200, SamplingParams(), 4, b"", 0)), 200)
    w.submit(Abort("c"))
    assert (w.queued, w.pending_tokens) == (2, 500)
    w._dispatch([], 1)  # a step applied the first add
    assert (w.queued, w.pending_tokens) == (1, 200)
    w._dispatch([], 1)
    assert (w.queued, w.pending_tokens) == (0, 0)


def test_the_time_a_request_waited_on_its_way_is_taken_off_the_limit() -> None:
    # The limit runs from the request's arrival in the scheduler (issue 43): 0.6 s of
    # queue ahead fits a 1 s limit for a fresh request, not for one that spent 0.5 s in
    # the scheduler and the node manager; an engine with nothing ahead takes one however
    # late (it makes no one wait, and refused it would only come back later).
    a = Admission(max_waiting=100, max_queue_delay_s=1.0)
    shape = QueueShape(waiting=1, prefill_tokens=600, seats=64, token_budget=1024,
                       prefill_s_per_token=0.001)
    a.check(1, 99.9, 100.0, shape=shape)
    a.check(1, 99.9, 100.0, shape=shape, waited_s=0.3)
    with pytest.raises(EngineError, match="after 0.50s on its way") as e:
        a.check(1, 99.9, 100.0, shape=shape, waited_s=0.5)
    assert e.value.code == "resource_exhausted"
    a.check(0, 0.0, 100.0, shape=QueueShape(seats=64, token_budget=1024), waited_s=1.2)
    a.check(0, 0.0, 100.0, waited_s=1.2)  # (costs not measured yet)
    a.check(0, 0.0, 100.0, bound_delay=False, waited_s=5.0)  # the node's queue chose
    Admission(max_waiting=3, max_queue_delay_s=0.0).check(0, 0.0, 100.0, waited_s=5.0)


def test_step_cost_learns_decode_and_prefill_costs_and_output_lengths() -> None:
    cost = StepCost(prefill_prior_s_per_token=0.5)
    cost.observe(decode_tokens=8, prefill_tokens=0, seconds=0.02)
    assert cost.decode_step_s == 0.02
    cost.observe(decode_tokens=8, prefill_tokens=10, seconds=1.0)  # too few: no sample
    assert cost.prefill_s_per_token == 0.5
    cost.observe(decode_tokens=8, prefill_tokens=100, seconds=0.12)  # 0.1 s for 100
    assert cost.prefill_s_per_token == pytest.approx(0.001)
    assert cost.expected_left(generated=3, most_left=500) == 500  # lengths not known yet
    for _ in range(8):
        cost.finished(20)
    assert cost.expected_left(generated=3, most_left=500) == 17
    assert cost.expected_left(generated=3, most_left=5) == 5
    assert cost.expected_left(generated=30, most_left=500) == 1


class BlockedWorker:
    """Hold the engine's worker thread (as a long forward pass would) until released."""

    def __init__(self, eng) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.job = eng._worker.run(self._hold)

    def _hold(self) -> None:
        self.started.set()
        self.release.wait(30)

    async def __aenter__(self) -> BlockedWorker:
        await asyncio.to_thread(self.started.wait, 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await self.job


async def test_status_answers_while_the_worker_is_busy(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        async with BlockedWorker(eng):
            started = time.monotonic()
            st = await eng.status(max_wait_s=0.05)
            assert time.monotonic() - started < 2.0
            assert st.models[0].name == loaded.name and st.running == 0
        await idle(eng)


async def test_a_queue_that_falls_behind_refuses_newcomers(loaded: LoadedModel) -> None:
    async with engine(loaded, max_num_seqs=1, max_queue_delay_s=0.05) as eng:
        first = eng.generate(greedy(PROMPTS[0], 3000))
        await first.__anext__()  # running: the one seat is taken
        second = eng.generate(greedy(PROMPTS[1], 4))
        head = asyncio.ensure_future(second.__anext__())
        while (await eng.status()).waiting < 1:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)  # the waiting one is now older than the bound
        await eng.status()  # (a fresh snapshot: the queue's age is read from it)
        with pytest.raises(EngineError, match="behind") as e:
            await eng.generate(greedy(PROMPTS[2], 4)).__anext__()
        assert e.value.code == "resource_exhausted"
        # One the node's deadline queue dispatched is queued all the same (Prism §6.3:
        # the node serves late requests after the others instead of refusing them).
        admitted = eng.generate(dataclasses.replace(greedy(PROMPTS[2], 2), node_admitted=True))
        late = asyncio.ensure_future(admitted.__anext__())
        while not late.done() and (await eng.status()).waiting < 2:
            await asyncio.sleep(0.005)
        assert not late.done(), late.exception()  # queued, not refused
        await first.aclose()
        await head
        await second.aclose()
        await late
        assert [o async for o in admitted][-1].finish_reason == "length"
        # Caught up: new requests are taken again.
        outs = [o async for o in eng.generate(greedy(PROMPTS[3], 2))]
        assert outs[-1].finish_reason == "length"
        await idle(eng)


class FixedStepCost(StepCost):
    """Step costs stubbed as measured: every decode step takes ``decode_step_s``."""

    def __init__(self, decode_step_s: float) -> None:
        super().__init__()
        self.decode_step_s = decode_step_s

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        pass


async def test_a_request_the_engine_cannot_start_in_time_is_refused(loaded: LoadedModel
                                                                    ) -> None:
    async with engine(loaded, max_num_seqs=1, max_queue_delay_s=0.5) as eng:
        core = eng._slot.core
        assert core is not None
        core.step_cost = FixedStepCost(0.01)  # 10 ms a step, as if measured
        first = eng.generate(greedy(PROMPTS[0], 3000))
        await first.__anext__()  # the one seat is taken for about 3000 more steps (30 s)
        while (snap := eng._worker.snapshot) is None or snap.queue.running < 1:
            await asyncio.sleep(0.005)
        # Nothing waits, yet a newcomer would wait for the seat far past the limit.
        with pytest.raises(EngineError, match="would wait about") as e:
            await eng.generate(greedy(PROMPTS[1], 4)).__anext__()
        assert e.value.code == "resource_exhausted"
        await first.aclose()
        while (await eng.status()).running:
            await asyncio.sleep(0.005)
        core.step_cost = FixedStepCost(0.0)
        await eng.status()
        outs = [o async for o in eng.generate(greedy(PROMPTS[1], 2))]  # a free seat: taken
        assert outs[-1].finish_reason == "length"
        await idle(eng)


def _hello(request_id: str, max_tokens: int) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id=request_id, prompt="hello", input_kind=common_pb2.GenerateRequest.PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


class _Context:
    async def abort(self, code, details):  # the real one raises; nothing aborts here
        raise AssertionError(f"aborted: {code} {details}")


async def test_a_quiet_stream_sends_keepalives(loaded: LoadedModel) -> None:
    async with engine(loaded, stream_keepalive_s=0.05) as eng:
        servicer = EngineServicer(eng)
        req = _hello("k1", 2)
        chunks = []
        async with BlockedWorker(eng) as blocked:
            stream = servicer.Generate(req, _Context())
            for _ in range(3):  # the worker is held: only keepalives can come
                chunks.append(await anext(stream))
            assert all(c.keepalive and not c.token_ids for c in chunks)
            blocked.release.set()
            rest = [c async for c in stream]
        real = [c for c in rest if not c.keepalive]
        assert sum(len(c.token_ids) for c in real) == 2 and real[-1].finish_reason == "length"
        await idle(eng)


async def test_closing_a_stream_mid_wait_aborts_the_request(loaded: LoadedModel) -> None:
    async with engine(loaded, stream_keepalive_s=0.05) as eng:
        servicer = EngineServicer(eng)
        req = _hello("k2", 400)
        async with BlockedWorker(eng):
            stream = servicer.Generate(req, _Context())
            assert (await anext(stream)).keepalive  # waiting on its first output
            await stream.aclose()  # as a cancelled call does, mid-wait
        await idle(eng)


async def test_a_stuck_step_sends_no_keepalives(loaded: LoadedModel) -> None:
    async with engine(loaded, stream_keepalive_s=0.05, max_step_s=1.0) as eng:
        servicer = EngineServicer(eng)
        req = _hello("k3", 2)
        async with BlockedWorker(eng):
            stream = servicer.Generate(req, _Context())
            assert (await anext(stream)).keepalive  # busy, not stuck: keepalives
            eng._worker.step_started = time.monotonic() - 5.0  # as if one step had run 5 s
            with pytest.raises(TimeoutError):  # stuck: silence, which the scheduler cuts
                await asyncio.wait_for(anext(stream), 0.5)
            eng._worker.step_started = 0.0
        await idle(eng)


class _Aborted(Exception):
    pass


class _AbortContext:
    async def abort(self, code, details):  # as grpc's does: raise, with what was sent
        raise _Aborted(f"{code.name}: {details}")


async def test_the_engine_counts_what_a_request_waited_on_its_way(loaded: LoadedModel
                                                                  ) -> None:
    # The wire carries how long the request waited before the engine got it (issue 43):
    # waited_ms, plus the hop from its node manager (sent_us, on this host's clock); the
    # engine's admission weighs it, and its first chunk says how long it held it.
    async with engine(loaded, max_queue_delay_s=0.5) as eng:
        servicer = EngineServicer(eng)
        seen: list[float] = []
        check = eng._admission.check

        def spy(*args, **kwargs):
            seen.append(kwargs.get("waited_s", args[5] if len(args) > 5 else 0.0))
            return check(*args, **kwargs)

        eng._admission.check = spy  # type: ignore[method-assign]
        late = _hello("w1", 2)
        late.waited_ms = 600
        late.sent_us = round((time.time() - 0.2) * 1e6)
        chunks = [c async for c in servicer.Generate(late, _AbortContext()) if not c.keepalive]
        assert 0.8 <= seen[0] < 5.0, seen  # 0.6 s before, 0.2 s from the node manager
        assert sum(len(c.token_ids) for c in chunks) == 2  # (nothing ahead: taken)
        firsts = [c for c in chunks if c.token_ids]
        assert firsts[0].engine_wait_ms > 0 and firsts[0].engine_received_us > 0
        assert all(c.engine_wait_ms == 0 for c in firsts[1:])
        await idle(eng)
