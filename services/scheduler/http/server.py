"""The scheduler's HTTP server: aiohttp's, hardened at the protocol level.

- A connection must deliver its first request's headers within ``header_timeout_s``
  (aiohttp has no such deadline: thousands of connections trickling header bytes were
  held open); idle keep-alive connections close after ``keepalive_timeout_s``.
- Errors the HTTP parser answers itself (a malformed request line, a header over the size
  limits, bad framing) leave in the OpenAI error shape like every other error, not as
  aiohttp's plain text.

aiohttp builds its per-connection ``RequestHandler`` inside ``Server.__call__``; the
runner's server is given a subclass whose handlers are ours (the only hook there is).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from services.scheduler.api import ApiError

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 8190  # the request line and any header line
MAX_HEADERS = 100
LINGER_S = 1.0  # reading what is left of a refused request's body, at most (default 10)


class _HardenedHandler(RequestHandler):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._header_deadline: asyncio.TimerHandle | None = loop.call_later(
            self.header_timeout_s, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_count and self._header_deadline is not None:
            self._header_deadline.cancel()  # the first request's headers are in
            self._header_deadline = None

    def connection_lost(self, exc: BaseException | None) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self._request_count and self.transport is not None:
            self.transport.close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            log.error("serving a request failed", exc_info=exc)
            text = "internal server error; see the scheduler log"
        else:
            text = f"malformed HTTP request ({type(exc).__name__ if exc else 'bad request'})"
            if message:
                text += f": {message[:200]}"
        body = ApiError(status, text, code="bad_http_request" if status < 500 else None).body()
        resp = web.Response(status=status, text=json.dumps(body),
                            content_type="application/json")
        resp.force_close()
        return resp


class _HardenedServer(Server):
    header_timeout_s: float = 10.0

    def __call__(self) -> RequestHandler:
        handler = _HardenedHandler(self, loop=self._loop, **self._kwargs)
        handler.header_timeout_s = self.header_timeout_s  # (before connection_made)
        return handler


class HardenedRunner(web.AppRunner):
    def __init__(self, app: web.Application, header_timeout_s: float,
                 keepalive_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=keepalive_timeout_s,
                         max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES,
                         max_headers=MAX_HEADERS, lingering_time=LINGER_S, **kwargs)
        self.header_timeout_s = header_timeout_s

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _HardenedServer  # (only __call__ differs)
        assert isinstance(server, _HardenedServer)
        server.header_timeout_s = self.header_timeout_s
        return server
