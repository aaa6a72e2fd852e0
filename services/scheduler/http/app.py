"""The aiohttp application: its state, the middleware every request passes (failures
leave as OpenAI error bodies; every request is counted by route and status) and the
route table, assembled from each route module's ``add_*_routes``."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from services.scheduler.api import ApiError
from services.scheduler.http.admin import add_admin_routes
from services.scheduler.http.advisory import add_advisory_routes
from services.scheduler.http.completions import add_completion_routes
from services.scheduler.http.health import add_health_routes
from services.scheduler.http.models import add_model_routes
from services.scheduler.http.pages import add_page_routes
from services.scheduler.http.responses import add_responses_routes
from services.scheduler.http.state import CLIENT_GONE, STATE, ApiState

log = logging.getLogger(__name__)


def error_response(e: ApiError) -> web.Response:
    resp = web.json_response(e.body(), status=e.status, headers=e.headers or None)
    if e.headers.get("Connection") == "close":
        resp.force_close()  # (a stalled body: its connection goes, with what it buffered)
    return resp


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body; every request is counted."""
    state = request.app[STATE]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    try:
        resp = await handler(request)
    except ApiError as e:
        resp = error_response(e)
    except web.HTTPRequestEntityTooLarge as e:
        resp = error_response(
            ApiError(413, e.text or "request body too large", code="body_too_large")
        )
    except web.HTTPException as e:
        resp = error_response(ApiError(e.status, e.reason or "request failed"))
    except asyncio.CancelledError:
        state.metrics.requests.labels(route, "499").inc()  # the client went away
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        resp = error_response(ApiError(500, "internal server error; see the scheduler log"))
    status = "499" if request.get(CLIENT_GONE) else str(resp.status)
    state.metrics.requests.labels(route, status).inc()
    return resp


# What a standby replica still answers: whether it lives, and whether it leads.
STANDBY_ROUTES = frozenset({"/healthz", "/leaderz", "/metrics"})


@web.middleware
async def _standby(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A standby replica (scheduler/lease.py) serves nothing else: it has no nodes."""
    if request.path not in STANDBY_ROUTES and not request.app[STATE].leader():
        raise ApiError(503, "this scheduler replica is a standby; retry (the Service "
                       "sends requests to the leader)", code="standby",
                       headers={"Retry-After": "1"})
    return await handler(request)


def build_app(state: ApiState) -> web.Application:
    # aiohttp enforces the body limit itself for bodies without a Content-Length.
    app = web.Application(middlewares=[_errors, _standby],
                          client_max_size=state.max_body_bytes)
    app[STATE] = state
    add_completion_routes(app)
    add_model_routes(app)
    add_health_routes(app)
    add_admin_routes(app)
    add_advisory_routes(app)
    add_responses_routes(app)
    add_page_routes(app)
    return app
