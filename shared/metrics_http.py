"""A tiny aiohttp server for ``GET /metrics`` (Prometheus text format): the kvstore, the
engine and the nodemgr each serve theirs on their ``metrics_port`` (the scheduler's is on
its public port)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

Render = Callable[[], Awaitable[bytes]]


@asynccontextmanager
async def serve_metrics(render: Render, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``/metrics`` (the bytes ``render`` makes, per scrape) on ``host:port`` while
    the context is open; yields the bound port."""

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=await render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

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
