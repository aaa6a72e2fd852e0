"""The NodeManager gRPC service: forward Generate to the engine, answer Status, take
advisories (prefetch the advised session's KV) and their invalidations."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.nodemgr import wire
from services.nodemgr.activation import Activator, CannotActivate
from services.nodemgr.admission import DeadlineAdmission, NodeQueueFull, estimate_tokens
from services.nodemgr.advisory_prefetcher import Advice, AdvisoryPrefetcher
from services.nodemgr.clock_offset import ClockOffset
from services.nodemgr.engine_set import EngineSet, EngineUnavailable, UnknownModel
from shared.proto import common_pb2, nodemgr_pb2, nodemgr_pb2_grpc

log = logging.getLogger(__name__)

PRUNE_AT = 4096  # advised sessions remembered before the lapsed ones are dropped
DEFAULT_HOLD_S = 60.0  # an advised model is held this long when the advisory names no TTL


class NodeManagerServicer(nodemgr_pb2_grpc.NodeManagerServicer):
    def __init__(
        self,
        node_id: str,
        engine: EngineSet,
        kvstore_address: str,
        on_engine_unavailable: Callable[[str], None],
        prefetcher: AdvisoryPrefetcher | None = None,
        activator: Activator | None = None,
        admission: DeadlineAdmission | None = None,
        clock: ClockOffset | None = None,
    ) -> None:
        self.node_id = node_id
        self.engine = engine
        self.kvstore_address = kvstore_address
        self.on_engine_unavailable = on_engine_unavailable
        self.prefetcher = prefetcher
        self.activator = activator or Activator(engine, (), evict_idle_s=0.0, wait_s=1.0)
        self.admission = admission or DeadlineAdmission()
        self.clock = clock or ClockOffset()  # the scheduler's (sent_us is on its clock)
        self.in_flight = 0
        # advisory id -> the activation it started, until that prefetches or the advisory ends
        self._activating: dict[str, asyncio.Task[None]] = {}
        # (tenant, session) -> its pending advisory, whose model is held from eviction
        # until the session's request comes or the advisory ends (``Activator.hold``)
        self._advised: dict[tuple[str, str], str] = {}

    async def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """Stream the engine's chunks unchanged; its status codes pass through.

        When the scheduler cancels (its client went away) grpc cancels this handler, and the
        ``finally`` cancels the engine call, which aborts the request in the engine.
        """
        received = time.monotonic()
        # On its way here since the scheduler sent it (a busy node's handler starts late).
        transit = self.clock.transit_s(request.sent_us / 1e6)
        self.in_flight += 1
        if self.prefetcher is not None:
            self.prefetcher.followed(request.tenant, request.session_id)
        self.activator.enter(request.model)  # (in use while it runs: the hold can go)
        advisory = self._advised.pop((request.tenant, request.session_id), None)
        if advisory is not None:
            self.activator.release(advisory)
        rid = wire.request_id_of(request)
        call = None
        slot = entering = None  # the admission slot, and the wait for it
        try:
            # Activating the model, then the node's deadline queue, may take a while: the
            # stream sends keepalives meanwhile (a silent one is cut as a stopped node).
            activating = self._evicted_here(request.model)
            asked_at = time.monotonic()
            finding = asyncio.ensure_future(self.activator.engine_for(request.model))
            async for keepalive in _until_done(finding, rid):
                yield keepalive
            # (the wait is the request's even if another request's activation did the work)
            waited = time.monotonic() - asked_at if activating else 0.0
            try:
                link = finding.result()
            except UnknownModel:
                served = ", ".join(repr(m) for m in self.engine.served()) or "none"
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"model {request.model!r} is not served on this node; "
                                    f"it serves {served}")
            except CannotActivate as e:
                # busy: retry later (429); a model that cannot load is the server's fault
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.busy
                        else grpc.StatusCode.INTERNAL)
                await context.abort(code, str(e))
            tokens = estimate_tokens(len(request.prompt) + sum(len(m.content)
                                                               for m in request.messages),
                                     len(request.prompt_token_ids))
            # One engine: its own queue orders its requests (and refuses them when behind);
            # several models: the node's queue orders them across engines by deadline.
            admission = (self.admission if len(self.engine.links) > 1
                         and self.admission.depth else None)
            slot = _slot(admission, request.model, link.address, tokens)
            entering = asyncio.ensure_future(slot.__aenter__())
            async for keepalive in _until_done(entering, rid):
                yield keepalive
            try:
                started = entering.result()
            except NodeQueueFull as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            # The node's queue chose when it starts: the engine does not refuse it as late.
            request.node_admitted = admission is not None
            # The time spent here counts against the engine's queue limit too.
            request.waited_ms += round((transit + time.monotonic() - received) * 1000)
            request.sent_us = round(time.time() * 1e6)  # (the engine shares our clock)
            call = link.stub.Generate(request, timeout=context.time_remaining())
            async for chunk in call:
                if chunk.token_ids or chunk.finish_reason:
                    started(chunk.prompt_tokens)
                if waited and not chunk.keepalive:
                    chunk.activation_s, waited = waited, 0.0
                yield chunk
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                log.error("engine unreachable during %s: %s", rid, e.details())
                self.on_engine_unavailable(e.details() or "UNAVAILABLE")
            await context.abort(e.code(), e.details() or e.code().name)
        finally:
            if call is not None:
                call.cancel()
            if (slot is not None and entering is not None and entering.done()
                    and not entering.cancelled() and entering.exception() is None):
                await slot.__aexit__(None, None, None)  # (the slot was taken: give it back)
            self.in_flight -= 1
            self.activator.leave(request.model)

    async def Status(
        self, request: nodemgr_pb2.NodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> nodemgr_pb2.NodeStatus:
        try:
            status = await self.engine.raw_status()
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return wire.node_status(self.node_id, status, self.kvstore_address)

    async def Advise(
        self, request: nodemgr_pb2.AdviseRequest, context: grpc.aio.ServicerContext
    ) -> nodemgr_pb2.AdviseReply:
        if not request.advisory_id or not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "advisory_id and session_id are required")
        advice = Advice(request.advisory_id, request.tenant, request.session_id,
                        request.kv_source, request.priority, request.ttl_s,
                        request.straight_to_device, request.kv_tokens, request.model)
        if self.prefetcher is None:
            return nodemgr_pb2.AdviseReply(accepted=False)
        if request.model in self.activator.catalog:
            # Its request is on its way: the model stays (or becomes) active until it
            # comes or the advisory ends (then it may be evicted again).
            self.activator.hold(advice.advisory_id, request.model,
                                request.ttl_s if request.ttl_s > 0 else DEFAULT_HOLD_S)
            old = self._advised.get((request.tenant, request.session_id))
            if old is not None and old != advice.advisory_id:
                self.activator.release(old)  # (replaced by this one)
            self._advised[(request.tenant, request.session_id)] = advice.advisory_id
            if len(self._advised) > PRUNE_AT:  # (ends the scheduler never told: lapsed)
                held = self.activator.holding()
                self._advised = {k: v for k, v in self._advised.items() if v in held}
        if self._evicted_here(request.model):
            # The advised model is in the catalogue but no engine here serves it: activate
            # it now, as its request would (Prism §6.2), then prefetch the session into it;
            # the request finds the model loaded and its KV on the way.
            task = asyncio.create_task(self._activate_then_advise(advice),
                                       name=f"activate-{request.model}")
            self._activating[advice.advisory_id] = task
            task.add_done_callback(
                lambda t: self._activating.pop(advice.advisory_id, None)
                if self._activating.get(advice.advisory_id) is t else None)
            return nodemgr_pb2.AdviseReply(accepted=True)
        return nodemgr_pb2.AdviseReply(accepted=self.prefetcher.advise(advice))

    def _evicted_here(self, model: str) -> bool:
        if not model or model not in self.activator.catalog:
            return False
        try:
            self.engine.for_model(model)
        except UnknownModel:
            return True
        return False

    async def _activate_then_advise(self, advice: Advice) -> None:
        self.activator.used(advice.model)  # (advised: not idle, not the next to evict)
        try:
            await self.activator.engine_for(advice.model)
        except (UnknownModel, CannotActivate) as e:
            log.info("advisory %s: %s not activated (%s); its request will activate it",
                     advice.advisory_id, advice.model, e)
            return
        # (an advisory that ended meanwhile leaves the model active and prefetches nothing)
        if self.prefetcher is not None and advice.advisory_id in self._activating:
            self.prefetcher.advise(advice)

    async def Invalidate(
        self, request: nodemgr_pb2.InvalidateRequest, context: grpc.aio.ServicerContext
    ) -> nodemgr_pb2.InvalidateReply:
        activating = self._activating.pop(request.advisory_id, None) is not None
        if self.activator.release(request.advisory_id):
            self._advised = {k: v for k, v in self._advised.items()
                             if v != request.advisory_id}
        found = self.prefetcher is not None and self.prefetcher.invalidate(
            request.advisory_id, request.expired)
        return nodemgr_pb2.InvalidateReply(found=found or activating)


    async def ActivateModel(
        self, request: nodemgr_pb2.ModelRequest, context: grpc.aio.ServicerContext
    ) -> nodemgr_pb2.ModelReply:
        try:
            await self.activator.engine_for(request.model)
        except (UnknownModel, CannotActivate) as e:
            return nodemgr_pb2.ModelReply(done=False, detail=str(e) or "not in the catalogue")
        return nodemgr_pb2.ModelReply(done=True)

    async def EvictModel(
        self, request: nodemgr_pb2.ModelRequest, context: grpc.aio.ServicerContext
    ) -> nodemgr_pb2.ModelReply:
        done = await self.activator.evict(request.model)
        return nodemgr_pb2.ModelReply(done=done, detail="" if done else "busy or not here")


@contextlib.asynccontextmanager
async def _slot(admission: DeadlineAdmission | None, model: str, engine: str, tokens: int
                ) -> AsyncIterator[Callable[[int], None]]:
    if admission is None:
        yield lambda tokens: None
        return
    async with admission.slot(model, engine, tokens) as started:
        yield started


KEEPALIVE_S = 1.0  # well under the scheduler's stream_idle_timeout_s


async def _until_done(task: asyncio.Future[Any], request_id: str
                      ) -> AsyncIterator[common_pb2.GenerateChunk]:
    """Keepalive chunks every KEEPALIVE_S until ``task`` is done (cancelled with the
    stream)."""
    try:
        while not (await asyncio.wait({task}, timeout=KEEPALIVE_S))[0]:
            yield common_pb2.GenerateChunk(request_id=request_id, keepalive=True)
    finally:
        if not task.done():
            task.cancel()
