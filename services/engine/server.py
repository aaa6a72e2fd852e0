"""The gRPC ``overture.v1.Engine`` service over an AsyncEngine."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc

from . import wire
from .async_engine import AsyncEngine
from .errors import EngineError

log = logging.getLogger(__name__)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """Stream chunks. A cancelled call cancels this handler; the generator's clean-up
        then aborts the request and frees its blocks."""
        req = wire.request_from_proto(request)
        try:
            async for out in self.engine.generate(req):
                yield wire.chunk_to_proto(out)
        except EngineError as e:
            log.info("Generate %s refused: %s %s", req.request_id, e.code, e.message)
            await context.abort(wire.STATUS_CODES[e.code], e.message)

    async def DropDeviceCache(
        self, request: engine_pb2.DropDeviceCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DropDeviceCacheReply:
        try:
            return wire.dropped_reply(await self.engine.drop_device_cache())
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises

    async def Status(
        self, request: engine_pb2.EngineStatusRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStatus:
        try:
            status = await self.engine.status()
            saved = self.engine.saved_after(wire.saved_after(request))
            return wire.status_to_proto(status, saved)
        except EngineError as e:
            await context.abort(wire.STATUS_CODES[e.code], e.message)
            raise  # unreachable: abort raises
