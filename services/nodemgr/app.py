"""``run(config)``: the node manager process."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.engine_link import EngineLink
from services.nodemgr.grpc_service import NodeManagerServicer
from services.nodemgr.kvstore_probe import KVStoreProbe
from services.nodemgr.metrics import NodeMgrMetrics
from services.nodemgr.prefetcher import Prefetcher
from services.nodemgr.registration import Registrar
from shared.grpc_server import serve_grpc
from shared.metrics_http import serve_metrics
from shared.proto import nodemgr_pb2_grpc

log = logging.getLogger(__name__)


async def start(config: NodeManagerConfig, stack: AsyncExitStack) -> asyncio.Task[None]:
    """Serve NodeManager, wait for the engine, then start registering and beating.

    Returns the registrar's task (owned by ``stack``). Raises ``EngineUnavailable`` when the
    engine is not ready within ``engine_wait_s``.
    """
    engine = EngineLink(config.engine_address, config.engine_status_timeout_s)
    stack.push_async_callback(engine.close)
    registrar: Registrar | None = None
    kvstore = KVStoreProbe(config.kvstore_address, config.kvstore_probe_timeout_s)
    stack.push_async_callback(kvstore.close)

    def engine_failed(detail: str) -> None:
        if registrar is not None:
            registrar.engine_failed(detail)

    metrics = NodeMgrMetrics()
    prefetcher = Prefetcher(config.kvstore_address, config.prefetch_timeout_s,
                            engine=engine.stub, metrics=metrics)
    stack.push_async_callback(prefetcher.close)
    servicer = NodeManagerServicer(config.node_id, engine, config.kvstore_address, engine_failed,
                                   prefetcher)
    server = await stack.enter_async_context(
        serve_grpc(
            config.host,
            config.port,
            register=[lambda s: nodemgr_pb2_grpc.add_NodeManagerServicer_to_server(servicer, s)],
            service_names=["overture.v1.NodeManager"],
        )
    )
    address = config.advertise_address or f"{config.host}:{server.port}"
    log.info("waiting for the engine at %s", config.engine_address)
    snap = await engine.wait_ready(config.engine_wait_s)
    registrar = Registrar(
        node_id=config.node_id,
        address=address,
        kvstore_address=config.kvstore_address,
        scheduler_address=config.scheduler_address,
        engine=engine,
        models=snap.models,
        interval_s=config.heartbeat_interval_s,
        backoff_max_s=config.register_backoff_max_s,
        in_flight=lambda: servicer.in_flight,
        kvstore=kvstore,
        engine_stall_s=config.engine_stall_s,
    )
    beats = asyncio.create_task(registrar.run(), name="registrar")
    if config.metrics_port:
        metrics.watch(lambda: _state(registrar, servicer))

        async def render() -> bytes:
            return metrics.render()

        mport = await stack.enter_async_context(
            serve_metrics(render, config.host, config.metrics_port))
        log.info("metrics on http://%s:%d/metrics", config.host, mport)

    async def stop_beats() -> None:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)

    stack.push_async_callback(stop_beats)
    log.info(
        "nodemgr %s ready on %s (engine %s, models %s)",
        config.node_id,
        address,
        config.engine_address,
        ", ".join(m.name for m in snap.models),
    )
    return beats


async def run(config: NodeManagerConfig) -> None:
    """Serve until cancelled (or until the registrar fails)."""
    async with AsyncExitStack() as stack:
        beats = await start(config, stack)
        await beats


def _state(registrar: Registrar, servicer: NodeManagerServicer) -> dict[str, float]:
    return {"generations_in_flight": float(servicer.in_flight),
            "problem": 1.0 if registrar.problem else 0.0,
            "degraded": 1.0 if registrar.degraded else 0.0}
