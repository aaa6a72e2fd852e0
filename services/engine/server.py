"""The gRPC ``overture.v1.Engine`` service over an AsyncEngine."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc

from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc

from . import wire
from .async_engine import AsyncEngine
from .errors import EngineError

log = logging.getLogger(__name__)

# Status waits this long for the worker's fresh counters, else answers from the last step's.
STATUS_WAIT_S = 0.05
DEFAULT_PREFETCH_TTL_S = 30.0  # an advisory's prefetch without a TTL of its own


def _exit_now() -> None:
    logging.shutdown()
    os._exit(70)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.keepalive_s = engine.config.stream_keepalive_s
        self.max_step_s = engine.config.max_step_s
        self.die_armed = False  # (debug_die_on_sigusr1: the next Generate ends the process)

    def arm_death(self) -> None:
        """Fault injection: exit as the next generation request arrives."""
        self.die_armed = True
        log.warning("SIGUSR1: this engine exits at its next generation request (fault "
                    "injection, engine.debug_die_on_sigusr1)")

    async def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """Stream chunks. A cancelled call cancels this handler; the generator's clean-up
        then aborts the request and frees its blocks."""
        if self.die_armed:  # (a crash mid-request, as a test needs it, deterministically)
            # The stream has started (the nodemgr relays it) when the engine fails the
            # request as a crashing one does (UNKNOWN) and the process goes.
            yield common_pb2.GenerateChunk(request_id=request.request_id, keepalive=True)
            log.error("crashing before the first token of a request (fault injection)")
            asyncio.get_running_loop().call_later(0.2, _exit_now)
            raise RuntimeError("engine crashed (fault injection)")
        received, received_wall = time.monotonic(), time.time()
        try:
            req = wire.request_from_proto(request)
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
        keepalive = common_pb2.GenerateChunk(request_id=req.request_id, keepalive=True)
        first = True
        outputs = self.engine.generate(req, coalesce=True)
        nxt: asyncio.Future | None = None
        try:
            while True:
                # Wait for the next output without cancelling it: a quiet stream (queued, a
                # long prefill) sends keepalives, so that silence means a stopped engine,
                # or a stuck one (a step running past max_step_s).
                nxt = asyncio.ensure_future(anext(outputs, None))
                while not (await asyncio.wait({nxt}, timeout=self.keepalive_s))[0]:
                    if self.engine.step_running_s() <= self.max_step_s:
                        yield keepalive
                out = nxt.result()
                if out is None:
                    break
                chunk = wire.chunk_to_proto(out)
                if first and out.token_ids:  # (the engine's share of the time to first token)
                    first = False
                    chunk.engine_wait_ms = round((time.monotonic() - received) * 1000)
                    chunk.engine_received_us = round(received_wall * 1e6)
                yield chunk
        except EngineError as e:
            log.info("Generate %s refused: %s %s", req.request_id, e.code, e.message)
            await context.abort(wire.STATUS_CODES[e.code], e.message)
        finally:
            # A cancelled call stops the generator where it waits; its clean-up aborts the
            # request in the engine.
            if nxt is not None:
                if not nxt.done():
                    nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)  # (its error, if any, taken)
            await outputs.aclose()

    async def DropDeviceCache(
        self, request: engine_pb2.DropDeviceCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DropDeviceCacheReply:
        try:
            return wire.dropped_reply(await self.engine.drop_device_cache())
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises

    async def Prefetch(
        self, request: engine_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.PrefetchReply:
        try:
            blocks = await self.engine.prefetch(
                request.tenant, request.session_id, priority=request.priority,
                ttl_s=request.ttl_s or DEFAULT_PREFETCH_TTL_S,
                straight=request.straight_to_device)
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises
        return engine_pb2.PrefetchReply(blocks=blocks)

    async def EndPrefetch(
        self, request: engine_pb2.EndPrefetchRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EndPrefetchReply:
        try:
            self.engine.end_prefetch(request.tenant, request.session_id, request.expired)
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
        return engine_pb2.EndPrefetchReply()

    async def Status(
        self, request: engine_pb2.EngineStatusRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStatus:
        try:
            status = await self.engine.status(max_wait_s=STATUS_WAIT_S)
            saved = self.engine.saved_after(wire.saved_after(request))
            return wire.status_to_proto(status, saved, time.monotonic())
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises

    async def Activate(
        self, request: engine_pb2.ActivateRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ActivateReply:
        started = time.perf_counter()
        try:
            info = await self.engine.activate(request.model_path, request.served_model_name,
                                              wire.stored_weights(request))
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises
        filled, fill_s = self.engine.last_fill if request.weights_arena else (0, 0.0)
        return engine_pb2.ActivateReply(model=info.to_proto(),
                                        seconds=time.perf_counter() - started,
                                        filled_bytes=filled, fill_seconds=fill_s)

    async def Evict(
        self, request: engine_pb2.EvictRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EvictReply:
        return engine_pb2.EvictReply(evicted=await self.engine.evict())

    async def ShrinkKV(
        self, request: engine_pb2.ShrinkKVRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ShrinkKVReply:
        try:
            pages = await self.engine.shrink_kv(max(0, request.max_pages))
            layers, lent = await self.engine.lend_to_node(request.lend_layers)
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises
        return engine_pb2.ShrinkKVReply(pages=pages, node_layers=layers, node_lent_bytes=lent)
