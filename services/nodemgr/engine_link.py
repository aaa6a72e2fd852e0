"""The node manager's connection to its engine: Status polling and start-up wait."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.nodemgr import wire
from services.nodemgr.channels import fast_channel
from shared.proto import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine did not answer (down, starting, or too slow)."""


class EngineLink:
    def __init__(self, address: str, status_timeout_s: float) -> None:
        self.address = address
        self.status_timeout_s = status_timeout_s
        self.channel = fast_channel(address)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    async def raw_status(self, saved_after: int = 0) -> engine_pb2.EngineStatus:
        try:
            status: engine_pb2.EngineStatus = await self.stub.Status(
                wire.status_request(saved_after), timeout=self.status_timeout_s
            )
            return status
        except grpc.aio.AioRpcError as e:
            raise EngineUnavailable(
                f"engine at {self.address} did not answer Status: {e.code().name} {e.details()}"
            ) from None

    async def status(self, saved_after: int = 0) -> wire.EngineSnapshot:
        """The engine's load, with the session saves numbered above ``saved_after``."""
        return wire.snapshot(await self.raw_status(saved_after))

    async def wait_ready(self, wait_s: float, poll_s: float = 0.2,
                         need_model: bool = True) -> wire.EngineSnapshot:
        """Poll Status until the engine serves a model (``need_model``; else until it
        answers: a standby engine, waiting for an activation); raise after ``wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        last = "no answer yet"
        while True:
            try:
                snap = await self.status()
                if snap.models or not need_model:
                    return snap
                last = "the engine serves no model yet"
            except EngineUnavailable as e:
                last = str(e)
            if loop.time() >= deadline:
                raise EngineUnavailable(
                    f"engine at {self.address} not ready after {wait_s:g}s ({last}); "
                    "is it running? raise nodemgr.engine_wait_s if it loads slowly"
                )
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        await self.channel.close()
