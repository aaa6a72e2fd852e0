"""The chat widget and the demo chat page (``clients/js``), served by the scheduler:
``/static/overture-widget.js`` for any page to import, and ``/`` a chat built on it with
a model picker. Both are public like health: they hold no data, and the page asks for an
API key before it calls the API."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

CLIENTS = Path(__file__).resolve().parents[3] / "clients" / "js"
WIDGET = CLIENTS / "overture-widget.js"
DEMO = CLIENTS / "demo.html"
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


async def widget(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(WIDGET, headers={**_HEADERS,
                                             "Content-Type": "text/javascript; charset=utf-8"})


async def demo_page(request: web.Request) -> web.StreamResponse:
    # (the page runs only its own script and talks only to this origin)
    csp = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; "
           "img-src 'self'; connect-src 'self'")
    return web.FileResponse(DEMO, headers={**_HEADERS, "Content-Security-Policy": csp,
                                           "Content-Type": "text/html; charset=utf-8"})


def add_static_routes(app: web.Application) -> None:
    app.router.add_get("/", demo_page)
    app.router.add_get("/static/overture-widget.js", widget)
