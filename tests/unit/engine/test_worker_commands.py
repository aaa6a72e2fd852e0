"""The worker's typed commands: each reaches the core method it names, in inbox order, on
the worker thread; an abort's last output reaches its stream; adds are counted as queued
until a step applies them. A recording core stands in for the EngineCore."""

from __future__ import annotations

import asyncio
import threading
from typing import cast

import pytest

from services.engine.api_types import EngineStatus, GenerateOutput, SamplingParams
from services.engine.engine_core import EngineCore, Event
from services.engine.errors import UNAVAILABLE, EngineError
from services.engine.offload import PrefetchOrder
from services.engine.reuse_plan import ReusePlan
from services.engine.validation import PreparedRequest
from services.engine.worker import (
    Abort,
    Add,
    Command,
    EndPrefetch,
    KVStoreAttached,
    LoadEnded,
    Prefetch,
    Unpin,
    Worker,
    apply,
)
from shared.session_key import SessionKey

SESSION = SessionKey("acme", "chat-1")
REQUEST = PreparedRequest("r1", [1, 2, 3], SamplingParams(), 4, b"seed", 0)
PLAN = ReusePlan((), "lease-1", 0, 2)
ORDER = PrefetchOrder(SESSION, (b"h0", b"h1"), PLAN)


def status() -> EngineStatus:
    return EngineStatus(models=(), blocks_total=0, blocks_free=0, blocks_used=0,
                        blocks_evictable=0, blocks_committed=0, running=0, waiting=0,
                        device_budget_bytes=0, block_bytes=0, device="cpu", pool_name="")


class RecordingCore:
    """Writes down each call, with the thread it came on."""

    budget_retry_at = 0.0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.threads: set[str] = set()

    def _note(self, *call: object) -> None:
        self.calls.append(call)
        self.threads.add(threading.current_thread().name)

    def add(self, request: PreparedRequest, plan: ReusePlan | None = None) -> None:
        self._note("add", request.request_id, plan)

    def abort(self, request_id: str) -> GenerateOutput:
        self._note("abort", request_id)
        return GenerateOutput(request_id, "", (), 3, 0, 0, "abort")

    def unpin(self, job_id: int, ok: bool = True) -> None:
        self._note("unpin", job_id, ok)

    def load_ended(self) -> None:
        self._note("load_ended")

    def kvstore_attached(self, blocks_per_chunk: int) -> None:
        self._note("attached", blocks_per_chunk)

    def prefetch(self, order: PrefetchOrder) -> None:
        self._note("prefetch", order.session)

    def end_prefetch(self, session: SessionKey, expired: bool = False) -> bool:
        self._note("end_prefetch", session, expired)
        return False

    def step(self) -> list[Event]:
        return []

    def status(self) -> EngineStatus:
        return status()

    def has_work(self) -> bool:
        return False

    def abort_all(self) -> list[GenerateOutput]:
        return []


class Sink:
    """The streams' side: every dispatch, and an event to await the next one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.dispatched = asyncio.Event()

    def dispatch(self, events: list[Event]) -> None:
        self.events.extend(events)
        self.dispatched.set()


def test_each_command_calls_its_core_method() -> None:
    core = RecordingCore()
    commands: list[Command] = [
        Add(REQUEST, PLAN), Unpin(7, ok=False), LoadEnded(), KVStoreAttached(4),
        Prefetch(ORDER), EndPrefetch(SESSION, expired=True), Abort("r1"),
    ]
    events = [apply(cast(EngineCore, core), c) for c in commands]
    assert core.calls == [
        ("add", "r1", PLAN), ("unpin", 7, False), ("load_ended",), ("attached", 4),
        ("prefetch", SESSION), ("end_prefetch", SESSION, True), ("abort", "r1"),
    ]
    # Only an abort makes an event: the request's last output.
    assert events[:-1] == [None] * 6
    last = events[-1]
    assert isinstance(last, GenerateOutput) and last.finish_reason == "abort"


def test_commands_are_plain_frozen_data() -> None:
    assert Unpin(7) == Unpin(7, True) and EndPrefetch(SESSION) == EndPrefetch(SESSION, False)
    assert len({Abort("a"), Abort("a"), LoadEnded(), LoadEnded()}) == 2


async def served(core: RecordingCore, sink: Sink) -> Worker:
    worker = Worker(sink)
    await worker.start(threads=0)
    await worker.serve(cast(EngineCore, core))
    return worker


async def stopped(worker: Worker) -> None:
    await worker.halt()
    worker.detach()
    worker.shutdown()


async def test_sent_commands_apply_in_order_on_the_worker_thread() -> None:
    core, sink = RecordingCore(), Sink()
    worker = await served(core, sink)
    try:
        for command in (Unpin(1), KVStoreAttached(2), EndPrefetch(SESSION)):
            worker._inbox.append(command)  # queued together, applied by one flush
        await worker.send(Abort("r9"))
        assert core.calls == [("unpin", 1, True), ("attached", 2),
                              ("end_prefetch", SESSION, False), ("abort", "r9")]
        assert core.threads and all(n.startswith("engine-step") for n in core.threads)
        # The abort's output went to the streams as the flush returned.
        assert [e.request_id for e in sink.events] == ["r9"]
    finally:
        await stopped(worker)


async def test_an_add_counts_as_queued_until_a_step_applies_it() -> None:
    core, sink = RecordingCore(), Sink()
    worker = await served(core, sink)
    try:
        sink.dispatched.clear()
        worker.submit(Add(REQUEST))
        assert worker.queued == 1  # admission counts it before the worker has it
        # The submit woke the step loop: the step applies it and publishes.
        await asyncio.wait_for(sink.dispatched.wait(), 10)
        assert core.calls == [("add", "r1", None)]
        assert worker.queued == 0 and worker.snapshot is not None
    finally:
        await stopped(worker)


async def test_detaching_forgets_the_adds_that_never_reached_the_core() -> None:
    core, sink = RecordingCore(), Sink()
    worker = await served(core, sink)
    try:
        await worker.halt()  # stepping ends (a model is being evicted)
        worker.submit(Add(REQUEST))
        worker.submit(Add(PreparedRequest("r2", [1], SamplingParams(), 4, b"seed", 0)))
        assert worker.queued == 2
        worker.detach()
        # The next model's admission must not count requests of the old one as queued.
        assert worker.queued == 0 and core.calls == []
    finally:
        worker.shutdown()


async def test_a_status_that_times_out_after_detaching_is_unavailable() -> None:
    core, sink = RecordingCore(), Sink()
    worker = await served(core, sink)
    gate = threading.Event()
    try:
        blocker = worker.run(gate.wait)  # the thread is busy (a long forward pass)
        asked = asyncio.ensure_future(worker.status(max_wait_s=0.2))
        await asyncio.sleep(0.05)  # the question waits behind the busy thread
        worker.detach()  # the model goes meanwhile: no snapshot to answer from
        with pytest.raises(EngineError) as raised:
            await asked
        assert raised.value.code == UNAVAILABLE
    finally:
        gate.set()
    await blocker
    await worker.halt()
    worker.shutdown()
