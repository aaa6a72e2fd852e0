"""Keep this node registered with the scheduler and beating.

Loop: register (retrying with backoff until the scheduler answers), open the Heartbeat
stream, send a beat every interval with the engine's load and any problem, and start over
when the scheduler forgets the node, the stream breaks, or the engine's models change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.nodemgr import wire
from services.nodemgr.channels import fast_channel
from services.nodemgr.engine_link import EngineLink, EngineUnavailable
from shared.proto import scheduler_pb2_grpc

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        kvstore_address: str,
        scheduler_address: str,
        engine: EngineLink,
        models: tuple[wire.ModelInfo, ...],
        interval_s: float,
        backoff_max_s: float,
        in_flight: Callable[[], int],
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.kvstore_address = kvstore_address
        self.scheduler_address = scheduler_address
        self.engine = engine
        self.models = models
        self.interval_s = interval_s
        self.backoff_max_s = backoff_max_s
        self.in_flight = in_flight
        self.problem = ""
        self._poke = asyncio.Event()
        # The newest engine save the scheduler acknowledged: each beat carries the ones
        # after it, so a beat lost with a broken stream is sent again.
        self.saved_acked = 0

    def engine_failed(self, detail: str) -> None:
        """A forwarded call found the engine unreachable: report it in a beat right now."""
        self.problem = f"engine unreachable: {detail}"
        self._poke.set()

    async def run(self) -> None:
        channel = fast_channel(self.scheduler_address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        backoff = 0.05
        try:
            while True:
                try:
                    interval = await self._register(stub)
                    backoff = 0.05
                    await self._beat(stub, interval)
                except (grpc.aio.AioRpcError, StreamEnded) as e:
                    # Say it once per outage; the retries themselves are routine.
                    level = logging.WARNING if backoff == 0.05 else logging.DEBUG
                    log.log(level, "scheduler at %s: %s; retrying", self.scheduler_address, _why(e))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.backoff_max_s)
        finally:
            await channel.close()

    async def _register(self, stub: scheduler_pb2_grpc.SchedulerStub) -> float:
        req = wire.register_request(self.node_id, self.address, self.models, self.kvstore_address)
        reply = await stub.RegisterNode(req, timeout=max(2.0, self.interval_s * 2))
        log.info(
            "registered with the scheduler at %s as %s (%s)",
            self.scheduler_address,
            self.node_id,
            ", ".join(m.name for m in self.models),
        )
        return wire.heartbeat_interval(reply) or self.interval_s

    async def _snapshot(self) -> wire.EngineSnapshot | None:
        try:
            snap = await self.engine.status(self.saved_acked)
        except EngineUnavailable as e:
            if not self.problem:
                log.error("%s; reporting the node as unable to serve", e)
            self.problem = str(e)
            return None
        if self.problem:
            log.info("engine answers again; the node can serve")
        self.problem = ""
        return snap

    async def _beat(self, stub: scheduler_pb2_grpc.SchedulerStub, interval: float) -> None:
        """Beat until the scheduler forgets us or the engine's models change (then return)."""
        call = stub.Heartbeat()
        try:
            while True:
                self._poke.clear()
                snap = await self._snapshot()
                if snap is not None and snap.models and snap.models != self.models:
                    log.info("engine models changed; registering again")
                    self.models = snap.models
                    return
                await call.write(wire.heartbeat(self.node_id, snap, self.in_flight(), self.problem))
                ack = await call.read()
                if ack is grpc.aio.EOF:
                    raise StreamEnded("the scheduler closed the heartbeat stream")
                if not ack.known:
                    log.info("the scheduler does not know this node; registering again")
                    return
                if snap is not None:
                    self.saved_acked = max(self.saved_acked, snap.last_saved)
                try:
                    await asyncio.wait_for(self._poke.wait(), interval)
                except TimeoutError:
                    pass
        finally:
            call.cancel()


class StreamEnded(Exception):
    """The scheduler ended the heartbeat stream (it is shutting down or restarting)."""


def _why(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return str(e)
