"""Keep this node registered with the scheduler and beating.

Loop: register (retrying with backoff until the scheduler answers), open the Heartbeat
stream, send a beat every interval with the engine's load and any problem, and start over
when the scheduler forgets the node, the stream breaks, or the engine's models change.

A scheduler that dies (kill -9, a restart, a Kubernetes failover) is routine: whatever
the broken stream raises (an RPC error, or ``InvalidStateError`` from a write to a call
that already finished), the node manager keeps serving the requests it has and retries
with a jittered, capped exponential backoff (every node must not knock at the same
instant), and registers again once a scheduler answers. The registration carries the
sessions whose KV this node saved (``held_sessions.py``), from which a restarted scheduler
rebuilds its session directory.

A *problem* takes the node out of rotation: the engine does not answer Status (down, or
stopped), or its forward step has run longer than ``engine_stall_s``. The engine answers
Status off its worker thread, so a busy engine is not mistaken for a dead one. A node
whose kvstore is down is *degraded*, not out: it serves by recomputing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import grpc

from services.nodemgr import wire
from services.nodemgr.channels import fast_channel
from services.nodemgr.clock_offset import ClockOffset
from services.nodemgr.engine_set import EngineSet, EngineUnavailable
from services.nodemgr.held_sessions import HeldSessions
from services.nodemgr.kvstore_probe import KVStoreProbe
from shared.aio import raise_if_cancel_requested
from shared.model_residency import ResidencySource
from shared.proto import scheduler_pb2_grpc

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05  # the first pause after a failure; doubles up to backoff_max_s


class Registrar:
    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        kvstore_address: str,
        scheduler_address: str,
        engine: EngineSet,
        models: tuple[wire.ModelInfo, ...],
        interval_s: float,
        backoff_max_s: float,
        in_flight: Callable[[], int],
        kvstore: KVStoreProbe | None = None,
        engine_stall_s: float = 120.0,
        held: HeldSessions | None = None,
        rng: random.Random | None = None,
        metrics: dict[str, str] | None = None,
        residency: ResidencySource | None = None,
        clock: ClockOffset | None = None,
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
        self.kvstore = kvstore
        self.engine_stall_s = engine_stall_s
        self.held = held if held is not None else HeldSessions(100_000)
        self.clock = clock if clock is not None else ClockOffset()  # the scheduler's
        self._rng = rng if rng is not None else random.Random()
        self.registrations = 0  # successful ones (the first, then one per reconnect)
        # service -> host:port of its /metrics, told to the scheduler (GET /admin/nodes)
        self.metrics = dict(metrics or {})
        # What of each model's weights the node holds and its load bandwidth, told in each
        # beat (Tangram §3.4): the node's Reuse Store, or ``residency.NodeResidency``.
        self.residency = residency
        self.problem = ""
        self.degraded = ""
        self._poke = asyncio.Event()
        # The heartbeat stream of a registration being replaced (the models changed): it
        # ends only once the new registration is in, so the scheduler never sees the node
        # gone meanwhile (it would take it out of rotation, and its models with it).
        self._replaced: grpc.aio.StreamStreamCall | None = None

    def models_changed(self) -> None:
        """A model was activated or evicted here: register the new list now."""
        self._poke.set()

    def engine_failed(self, detail: str) -> None:
        """A forwarded call found the engine unreachable: report it in a beat right now."""
        self.problem = f"engine unreachable: {detail}"
        self._poke.set()

    async def run(self) -> None:
        channel = fast_channel(self.scheduler_address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        backoff = FIRST_BACKOFF_S
        try:
            while True:
                try:
                    interval = await self._register(stub)
                    self._end_replaced()
                    backoff = FIRST_BACKOFF_S
                    await self._beat(stub, interval)
                except (grpc.aio.AioRpcError, StreamEnded, asyncio.InvalidStateError,
                        grpc.aio.UsageError) as e:
                    # Say it once per outage; the retries themselves are routine.
                    level = logging.WARNING if backoff == FIRST_BACKOFF_S else logging.DEBUG
                    log.log(level, "scheduler at %s: %s; retrying", self.scheduler_address, _why(e))
                except Exception:  # (a node must outlive any scheduler fault: never exit)
                    log.exception("registration with %s failed; retrying", self.scheduler_address)
                raise_if_cancel_requested()  # (an error above may have been our own cancel)
                # Full jitter in [backoff/2, backoff]: after a scheduler restart the nodes
                # come back spread out instead of all at once.
                await asyncio.sleep(backoff * self._rng.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.backoff_max_s)
        finally:
            self._end_replaced()
            await channel.close()

    def _end_replaced(self) -> None:
        if self._replaced is not None:
            self._replaced.cancel()
            self._replaced = None

    async def _seed_held(self) -> None:
        """Learn the sessions the kvstore holds (it keeps them across restarts of this
        process and of the scheduler); what it cannot tell now is left for the next
        registration (the node registers all the same)."""
        if self.kvstore is None:
            return
        try:
            stored = await self.kvstore.stored_sessions(self.held.capacity)
        except grpc.aio.AioRpcError as e:
            log.warning("the kvstore did not list its sessions (%s); registering with the "
                        "%d sessions saved here", e.code().name, len(self.held))
            return
        for s in stored:
            self.held.seed(s.tenant, s.session_id, s.tokens, s.age_s)

    async def _register(self, stub: scheduler_pb2_grpc.SchedulerStub) -> float:
        if self._replaced is None:  # (over a live stream the record is current: no scan)
            await self._seed_held()
        held = self.held.held()
        req = wire.register_request(self.node_id, self.address, self.models,
                                    self.kvstore_address, held, self.metrics)
        reply = await stub.RegisterNode(req, timeout=max(2.0, self.interval_s * 2))
        self.registrations += 1
        log.info(
            "registered with the scheduler at %s as %s (%s; %d sessions held)",
            self.scheduler_address,
            self.node_id,
            ", ".join(m.name for m in self.models),
            len(held),
        )
        return wire.heartbeat_interval(reply) or self.interval_s

    async def _snapshot(self) -> wire.EngineSnapshot | None:
        try:
            snap = await self.engine.status()
        except EngineUnavailable as e:
            if not self.problem:
                log.error("%s; reporting the node as unable to serve", e)
            self.problem = str(e)
            return None
        if snap.step_running_s > self.engine_stall_s:
            problem = (f"the engine's forward step has run {snap.step_running_s:.0f}s "
                       f"(over nodemgr.engine_stall_s={self.engine_stall_s:g}s)")
            if not self.problem:
                log.error("%s; reporting the node as unable to serve", problem)
            self.problem = problem
            return snap
        if self.problem:
            log.info("engine answers again; the node can serve")
        self.problem = ""
        return snap

    async def _check_kvstore(self) -> None:
        degraded = await self.kvstore.problem() if self.kvstore is not None else ""
        if degraded != self.degraded:
            if degraded:
                log.error("%s; reporting the node as degraded", degraded)
            else:
                log.info("the kvstore answers again; the node is no longer degraded")
        self.degraded = degraded

    async def _beat(self, stub: scheduler_pb2_grpc.SchedulerStub, interval: float) -> None:
        """Beat until the scheduler forgets us or the engine's models change (then return)."""
        call = stub.Heartbeat()
        try:
            while True:
                self._poke.clear()
                snap, _ = await asyncio.gather(self._snapshot(), self._check_kvstore())
                if snap is not None and snap.models != self.models:
                    log.info("engine models changed; registering again")
                    self.models = snap.models
                    self._replaced, call = call, None  # (ended after the registration)
                    return
                sent = time.time()
                await call.write(wire.heartbeat(self.node_id, snap, self.in_flight(), self.problem,
                                                self.degraded, self.residency))
                ack = await call.read()
                if ack is grpc.aio.EOF:
                    raise StreamEnded("the scheduler closed the heartbeat stream")
                self.clock.observe(sent, time.time(), ack.scheduler_time_us / 1e6)
                if not ack.known:
                    log.info("the scheduler does not know this node; registering again")
                    return
                if snap is not None:  # (a beat lost with a broken stream is sent again)
                    self.held.record(snap.saved)
                    self.engine.acked(snap)
                try:
                    await asyncio.wait_for(self._poke.wait(), interval)
                except TimeoutError:
                    pass
                raise_if_cancel_requested()
        finally:
            if call is not None:
                call.cancel()


class StreamEnded(Exception):
    """The scheduler ended the heartbeat stream (it is shutting down or restarting)."""


def _why(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return str(e)
