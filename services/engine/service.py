"""``run(config)``: the engine process — an AsyncEngine served over gRPC."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack

from shared.aio import freeze_startup_heap
from shared.cpus import pin_process
from shared.grpc_server import serve_grpc
from shared.metrics_http import serve_metrics
from shared.proto import engine_pb2_grpc

from .async_engine import AsyncEngine
from .config import EngineConfig
from .metrics import render_engine_metrics
from .server import STATUS_WAIT_S, EngineServicer

log = logging.getLogger(__name__)

SERVICE_NAME = "overture.v1.Engine"


async def run(config: EngineConfig) -> None:
    """Load the model, serve until cancelled, then stop the server before the engine
    (in-flight streams end first) and free the KV pool's shared memory."""
    pin_process(config.cpus)  # before the worker and its OpenMP team start: they inherit it
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(AsyncEngine(config))
        servicer = EngineServicer(engine)
        server = await stack.enter_async_context(
            serve_grpc(
                config.host,
                config.port,
                register=[lambda s: engine_pb2_grpc.add_EngineServicer_to_server(servicer, s)],
                service_names=[SERVICE_NAME],
            )
        )
        if config.metrics_port:
            async def render() -> bytes:
                return render_engine_metrics(await engine.status(max_wait_s=STATUS_WAIT_S))

            mport = await stack.enter_async_context(
                serve_metrics(render, config.host, config.metrics_port))
            log.info("metrics on http://%s:%d/metrics", config.host, mport)
        if config.debug_die_on_sigusr1:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, servicer.arm_death)
        freeze_startup_heap()
        log.info("engine ready on %s:%d", config.host, server.port)
        await asyncio.Event().wait()  # until cancelled (SIGTERM/SIGINT)
