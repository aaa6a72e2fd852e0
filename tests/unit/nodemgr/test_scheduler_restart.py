"""A node manager rides out its scheduler's death: whatever the broken heartbeat stream
raises, it retries with a jittered, capped backoff, registers again when a scheduler
answers, and that registration carries the sessions whose KV the node saved."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import grpc

from services.nodemgr import wire
from services.nodemgr.held_sessions import HeldSessions
from services.nodemgr.registration import Registrar
from shared.grpc_server import serve_grpc
from shared.model_info import ModelInfo
from shared.proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc

MODELS = (ModelInfo("demo", "fp", 64),)


class FakeEngines:
    """The EngineSet as the registrar uses it: one save reported until acked."""

    def __init__(self) -> None:
        self.acked_seq = 0

    async def status(self) -> wire.EngineSnapshot:
        saved = () if self.acked_seq else (
            common_pb2.SessionSaved(tenant="t", session_id="chat-1", tokens=48, seq=1),)
        return wire.EngineSnapshot(models=MODELS, saved=saved)

    def acked(self, snap: wire.EngineSnapshot) -> None:
        self.acked_seq = max(self.acked_seq, snap.last_saved)


class DyingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Accepts registrations; ends each heartbeat stream after ``beats`` acks, while the
    node waits for its next beat: its next write meets a finished call, as when the
    scheduler is killed between two beats."""

    def __init__(self, beats: int) -> None:
        self.beats = beats
        self.registrations: list[scheduler_pb2.RegisterNodeRequest] = []

    async def RegisterNode(self, request, context):
        self.registrations.append(request)
        return scheduler_pb2.RegisterNodeReply(accepted=True, heartbeat_interval_s=0.1)

    async def Heartbeat(self, request_iterator: AsyncIterator, context):
        for _ in range(self.beats):
            if await context.read() is grpc.aio.EOF:
                return
            await context.write(scheduler_pb2.HeartbeatAck(known=True, in_rotation=True))


async def serve(stack: AsyncExitStack, servicer: DyingScheduler, port: int = 0) -> int:
    server = await stack.enter_async_context(serve_grpc(
        "127.0.0.1", port,
        register=[lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s)],
        service_names=[], grace_s=0.0))
    return server.port


def registrar(port: int, held: HeldSessions | None = None) -> Registrar:
    return Registrar(node_id="n0", address="127.0.0.1:1", kvstore_address="127.0.0.1:2",
                     scheduler_address=f"127.0.0.1:{port}", engine=FakeEngines(),  # type: ignore[arg-type]
                     models=MODELS, interval_s=0.02, backoff_max_s=0.05,
                     in_flight=lambda: 0, held=held, rng=random.Random(0))


async def wait_for(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_streams_that_end_under_the_node_never_end_the_node_manager() -> None:
    async with AsyncExitStack() as stack:
        sched = DyingScheduler(beats=1)
        port = await serve(stack, sched)
        reg = registrar(port)
        task = asyncio.create_task(reg.run())
        try:
            # Each registration's stream ends after one beat; the node keeps coming back.
            await wait_for(lambda: len(sched.registrations) >= 8 or task.done())
            assert not task.done(), task.exception()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_registers_again_with_its_sessions_when_a_killed_scheduler_returns() -> None:
    async with AsyncExitStack() as outer:
        first = DyingScheduler(beats=1_000_000)
        inner = AsyncExitStack()
        port = await serve(inner, first)
        held = HeldSessions(10)
        reg = registrar(port, held)
        task = asyncio.create_task(reg.run())
        outer.push_async_callback(lambda: asyncio.gather(task, return_exceptions=True))
        outer.callback(task.cancel)
        await wait_for(lambda: len(held) == 1)  # the save was beaten and acked
        assert first.registrations[0].sessions == []
        await inner.aclose()  # the scheduler dies under the open stream
        await asyncio.sleep(0.3)  # the node retries meanwhile
        assert not task.done(), task.exception()
        second = DyingScheduler(beats=1_000_000)
        await serve(outer, second, port)
        await wait_for(lambda: bool(second.registrations))
        sessions = second.registrations[0].sessions
        assert [(s.tenant, s.session_id, s.tokens) for s in sessions] == [("t", "chat-1", 48)]
        assert 0.0 <= sessions[0].age_s < 60.0
