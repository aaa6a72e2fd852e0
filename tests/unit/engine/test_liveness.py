"""Busy is not dead: Status answers while the worker is busy, quiet streams send
keepalives, and an engine that is behind refuses new requests instead of queueing them."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from services.engine.admission import Admission
from services.engine.errors import EngineError
from services.engine.model import LoadedModel
from services.engine.server import EngineServicer
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


def test_admission_predicts_the_wait_from_the_drain_rate() -> None:
    a = Admission(max_waiting=100, max_queue_delay_s=1.0)
    a.observe(0.0, 0, 0)
    a.observe(10.0, 20, 0)  # light load: nobody waited, so 2/s is demand, not capacity
    assert a.drain_rate() == 0.0
    a.check(5, 9.9, 10.0)  # unknown rate: only the oldest's wait is checked
    a.observe(11.0, 21, 6)
    a.observe(13.0, 31, 4)  # 10 taken in the 2 s that requests waited: 5/s
    assert a.drain_rate() == 5.0
    a.check(3, 12.9, 13.0)  # the 4th in line waits about 0.8 s
    with pytest.raises(EngineError, match="5 queued, taken at 5.0/s"):
        a.check(5, 12.9, 13.0)  # the 6th would wait 1.2 s
    for t in range(14, 24):  # the rate covers only the last few backlogged seconds
        a.observe(float(t), 31 + 20 * (t - 13), 3)
    assert a.drain_rate() == 20.0
    a.observe(23.5, 241, 0)  # the queue empties; the engine idles
    assert a.drain_rate(now=34.0) == 0.0  # idle for a while since: forgotten
    a.check(3, 0.0, 34.0)  # so a burst (an n=4 request) on an idle engine is taken
    a.observe(40.0, 241, 2)
    a.observe(41.0, 246, 2)
    assert a.drain_rate(now=41.0) == 5.0
    a.observe(42.0, 0, 0)  # a restarted core counts from zero: the rate is unknown again
    assert a.drain_rate() == 0.0


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
