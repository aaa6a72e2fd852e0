"""The NodeManager gRPC service: forward Generate to the engine, answer Status."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc

from services.nodemgr import wire
from services.nodemgr.engine_link import EngineLink, EngineUnavailable
from shared.proto import common_pb2, nodemgr_pb2, nodemgr_pb2_grpc

log = logging.getLogger(__name__)


class NodeManagerServicer(nodemgr_pb2_grpc.NodeManagerServicer):
    def __init__(
        self,
        node_id: str,
        engine: EngineLink,
        kvstore_address: str,
        on_engine_unavailable: Callable[[str], None],
    ) -> None:
        self.node_id = node_id
        self.engine = engine
        self.kvstore_address = kvstore_address
        self.on_engine_unavailable = on_engine_unavailable
        self.in_flight = 0

    async def Generate(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """Stream the engine's chunks unchanged; its status codes pass through.

        When the scheduler cancels (its client went away) grpc cancels this handler, and the
        ``finally`` cancels the engine call, which aborts the request in the engine.
        """
        self.in_flight += 1
        remaining = context.time_remaining()
        call = self.engine.stub.Generate(request, timeout=remaining)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                log.error("engine unreachable during %s: %s", wire.request_id_of(request),
                          e.details())
                self.on_engine_unavailable(e.details() or "UNAVAILABLE")
            await context.abort(e.code(), e.details() or e.code().name)
        finally:
            call.cancel()
            self.in_flight -= 1

    async def Status(
        self, request: nodemgr_pb2.NodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> nodemgr_pb2.NodeStatus:
        try:
            status = await self.engine.raw_status()
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return wire.node_status(self.node_id, status, self.kvstore_address)
