"""The documents the scheduler serves to anyone, like health: ``/openapi.json`` (the API
as this server's limits shape it), and the chat widget and demo chat page (``clients/js``):
``/static/overture-widget.js`` for any page to import, and ``/`` a chat built on it with
a model picker. None holds data; the page asks for an API key before it calls the API."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from services.scheduler.api import openapi_document
from services.scheduler.http.state import STATE

CLIENTS = Path(__file__).resolve().parents[3] / "clients" / "js"
WIDGET = CLIENTS / "overture-widget.js"
DEMO = CLIENTS / "demo.html"
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[STATE].limits))


async def widget(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(WIDGET, headers={**_HEADERS,
                                             "Content-Type": "text/javascript; charset=utf-8"})


async def demo_page(request: web.Request) -> web.StreamResponse:
    # (the page runs only its own script and talks only to this origin)
    csp = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; "
           "img-src 'self'; connect-src 'self'")
    return web.FileResponse(DEMO, headers={**_HEADERS, "Content-Security-Policy": csp,
                                           "Content-Type": "text/html; charset=utf-8"})


def add_page_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/", demo_page)
    app.router.add_get("/static/overture-widget.js", widget)
