"""A tiny aiohttp server for ``GET /metrics`` (Prometheus text format)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.kvstore.metrics import KVStoreMetrics


@asynccontextmanager
async def serve_metrics(metrics: KVStoreMetrics, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``/metrics`` on ``host:port`` while the context is open; yields the bound port."""

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()
