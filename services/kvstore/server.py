"""``run(config)``: the kvstore process — tiers, store, gRPC service, metrics — in one stack.

Shutdown order (reverse of start): stop the metrics endpoint, stop gRPC (grace), let the
pool path's pending manifests finish, end its leases and unmap the engine pools, drain
the write-behind for up to ``drain_s`` seconds, close S3, then RocksDB, then DRAM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from contextlib import AsyncExitStack

from services.kvstore.config import KVStoreConfig
from services.kvstore.engine_path.copies import lazy_torch
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.manifests import ManifestStore
from services.kvstore.manifests.retention import RetentionIndex
from services.kvstore.manifests.retention_sweep import retention_loop
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.peers.data_plane import ChunkServer
from services.kvstore.service import KVStoreService
from services.kvstore.store import TieredStore
from services.kvstore.tiers import build_tiers
from shared.aio import freeze_startup_heap
from shared.cpus import pin_process
from shared.grpc_server import serve_grpc
from shared.metrics_http import Render, serve_metrics
from shared.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "overture.v1.KVStore"


def build_store(config: KVStoreConfig, metrics: KVStoreMetrics,
                retention: RetentionIndex | None = None) -> TieredStore:
    """A closed store for ``config`` (enter it with ``async with``). Raises ConfigError."""
    return TieredStore(
        build_tiers(config),
        metrics,
        write_queue=config.write_queue,
        write_workers=config.write_workers,
        retry_backoff_max_s=config.retry_backoff_max_s,
        local_ttl_s=config.local_ttl_s,
        ttl_s=config.ttl_s,
        sweep_interval_s=config.sweep_interval_s,
        drain_s=config.drain_s,
        retained=retention.kept_keys if retention is not None else None,
    )


async def run(config: KVStoreConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set).

    Raises ``TierOpenError``/``ConfigError`` at start (the caller exits non-zero).
    """
    pin_process(config.cpus)
    os.umask(0o077)  # tenants' KV on disk (the SSD tier, RocksDB's files): owner only
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = KVStoreMetrics()
    async with AsyncExitStack() as stack:
        retention = RetentionIndex(config.ttl_s, config.retention_sessions)
        store = await stack.enter_async_context(build_store(config, metrics, retention))
        # The pool path needs torch, whose import takes seconds: start it now (the tiers
        # opened), off the loop, so the engine's first AttachPool does not wait for it.
        warm_torch = asyncio.create_task(asyncio.to_thread(lazy_torch), name="import-torch")
        stack.push_async_callback(asyncio.gather, warm_torch, return_exceptions=True)
        manifests = await stack.enter_async_context(
            ManifestStore(store, config.drain_s, retention))
        expiry = asyncio.create_task(retention_loop(manifests, config.sweep_interval_s),
                                     name="kv-retention")
        stack.push_async_callback(_cancelled, expiry)
        pool_path = await stack.enter_async_context(
            EnginePoolPath(
                store,
                config.chunk_tokens,
                lease_s=config.lease_s,
                readahead_layers=config.load_readahead_layers,
                remote_readahead_layers=config.load_readahead_remote_layers,
                drain_s=config.drain_s,
                manifests=manifests,
                peer_wait_s=config.peer_wait_s,
                peer_timeout_s=config.peer_timeout_s,
                peer_bytes_per_s=config.peer_bytes_per_s,
                debug_save_delay_s=config.debug_save_delay_s,
            )
        )
        chunks = ChunkServer(store, pool_path.held_blobs, config.host,
                             config.peer_data_port, config.debug_chunk_delay_s,
                             config.peer_timeout_s)
        pool_path.data_port = await chunks.start()
        stack.push_async_callback(chunks.close)
        service = KVStoreService(
            manifests, config.node_id, config.stream_window, config.peer_address, pool_path,
            config.peer_timeout_s, config.prefetch_join_s,
        )
        server = await stack.enter_async_context(
            serve_grpc(
                config.host,
                config.port,
                register=[lambda s: pb_grpc.add_KVStoreServicer_to_server(service, s)],
                service_names=[SERVICE_NAME],
            )
        )
        if config.metrics_port:
            mport = await stack.enter_async_context(
                serve_metrics(_render(metrics), config.host, config.metrics_port)
            )
            log.info("metrics on http://%s:%d/metrics", config.host, mport)
        tiers = ", ".join(t.name for t in store.tiers)
        freeze_startup_heap()
        log.info("kvstore ready on %s:%d (tiers: %s; chunk stream for peers on port %d)",
                 config.host, server.port, tiers, pool_path.data_port)
        await stop.wait()
        log.info("kvstore shutting down")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _render(metrics: KVStoreMetrics) -> Render:
    async def render() -> bytes:
        return metrics.render()

    return render
