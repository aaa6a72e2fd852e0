"""The public HTTP API: OpenAI endpoints, health, readiness and metrics (aiohttp)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from services.scheduler.advisory.advisor import Advisor
from services.scheduler.api.errors import ApiError
from services.scheduler.api.openai_format import (
    SSE_DONE,
    ChoiceState,
    Envelope,
    full_response,
    new_id,
    sse,
    stream_chunk,
    tool_call_deltas,
    usage_chunk,
)
from services.scheduler.api.openapi import openapi_document
from services.scheduler.api.request import ApiRequest, Endpoint
from services.scheduler.api.validation import (
    Limits,
    check_body_size,
    check_prompt_length,
    parse_json,
    validate,
)
from services.scheduler.cluster.registry import Node, NodeRegistry
from services.scheduler.http.admin import add_admin_routes
from services.scheduler.http.advisory import add_advisory_routes
from services.scheduler.http.pages import add_static_routes
from services.scheduler.http.responses import add_responses_routes
from services.scheduler.metrics import CONTENT_TYPE, SchedulerMetrics
from services.scheduler.responses import ResponseStore
from services.scheduler.routing.dispatch import Dispatcher
from services.scheduler.routing.fanout import run_choices
from services.scheduler.tenants.keys import KeyBook
from services.scheduler.tenants.limits import TenantLimits
from services.scheduler.wire import Chunk
from shared.model_catalog import ModelEntry

log = logging.getLogger(__name__)


@dataclass
class ApiState:
    registry: NodeRegistry
    dispatcher: Dispatcher
    metrics: SchedulerMetrics
    limits: Limits
    keys: KeyBook
    max_body_bytes: int
    tenants: TenantLimits = field(default_factory=lambda: TenantLimits(0, 0, 0))
    body_timeout_s: float = 30.0
    advisor: Advisor = field(default=None)  # type: ignore[assignment]  # (set by build_state)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(3600.0, 10_000))


STATE = web.AppKey("state", ApiState)
CLIENT_GONE = "overture.client_gone"  # request key: the client left mid-stream (counted as 499)
NODE_HEADER = "X-Overture-Node"  # the node that served a generation


def error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers or None)


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


def tenant_of(state: ApiState, request: web.Request) -> str:
    """The tenant of the request's API key (401 without a known one)."""
    return state.keys.tenant_of(request.headers.get("Authorization", ""))


async def read_body(state: ApiState, request: web.Request) -> bytes:
    """The whole body, within the size limit and ``body_timeout_s`` (a client trickling
    its upload holds no memory and no connection for long)."""
    check_body_size(request.content_length, state.max_body_bytes)
    try:
        async with asyncio.timeout(state.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within "
                       f"{state.body_timeout_s:g} s", code="body_timeout") from None


class Timing:
    """TTFT per request and inter-token latency per choice; with the model's SLOs (the
    catalogue's), whether the request met them (``done``)."""

    def __init__(self, metrics: SchedulerMetrics, model: str,
                 slo: ModelEntry | None = None) -> None:
        # (labelled at the first token: a model name nobody serves never becomes a label)
        self.ttft = functools.partial(metrics.ttft.labels, model)
        self.itl = functools.partial(metrics.itl.labels, model)
        self.generated = functools.partial(metrics.tokens.labels, model)
        self.attained = functools.partial(metrics.slo_attained.labels, model)
        self.slo = slo
        self.start = time.monotonic()
        self.first = False
        self.first_at = 0.0
        self.last: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.began: dict[int, float] = {}

    def done(self) -> None:
        """The request ended: count whether it met its model's TTFT and TPOT SLOs."""
        if self.slo is None or not self.first:
            return
        ttft = self.first_at - self.start
        self.attained("ttft", "yes" if ttft <= self.slo.ttft_slo_s else "no").inc()
        tpots = [(self.last[i] - self.began[i]) / (n - 1)
                 for i, n in self.count.items() if n > 1]
        if tpots:
            ok = max(tpots) <= self.slo.tpot_slo_s
            self.attained("tpot", "yes" if ok else "no").inc()

    def tokens(self, index: int, count: int) -> None:
        if count <= 0:
            return
        self.generated().inc(count)
        now = time.monotonic()
        if not self.first:
            self.first = True
            self.first_at = now
            self.ttft().observe(now - self.start)
        self.began.setdefault(index, now)
        self.count[index] = self.count.get(index, 0) + count
        prev = self.last.get(index)
        if prev is not None:
            gap = (now - prev) / count
            itl = self.itl()
            for _ in range(count):
                itl.observe(gap)
        self.last[index] = now


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    state.tenants.request(tenant)
    body = parse_json(await read_body(state, request))
    req = validate(
        body,
        endpoint,
        state.limits,
        session_header=request.headers.get("X-Session-Id", ""),
        tenant=tenant,
    )
    model = await state.dispatcher.resolve_model(req.model)
    check_prompt_length(req, state.registry.max_model_len(model))
    with state.tenants.in_flight(tenant):
        return await _generate_in_flight(request, state, req, endpoint, model)


async def _generate_in_flight(request: web.Request, state: ApiState, req: ApiRequest,
                              endpoint: Endpoint, model: str) -> web.StreamResponse:
    env = Envelope(endpoint, new_id(endpoint), model)
    states = {c.index: ChoiceState(c.index, c.prompt_index) for c in req.choices()}
    timing = Timing(state.metrics, model, state.dispatcher.catalog.get(model))
    state.metrics.in_flight.inc()
    try:
        async with aclosing(run_choices(state.dispatcher, req, model, env.id)) as events:
            if req.stream:
                return await _stream(request, req, env, states, timing, events)
            nodes: list[str] = []
            async for index, chunk in events:
                states[index].add(chunk)
                timing.tokens(index, len(chunk.token_ids))
                if chunk.node and chunk.node not in nodes:
                    nodes.append(chunk.node)
            return web.json_response(
                full_response(env, list(states.values()), req.return_token_ids),
                headers={NODE_HEADER: ",".join(nodes)} if nodes else None,
            )
    finally:
        timing.done()
        state.metrics.in_flight.dec()


def _chunk_events(
    req: ApiRequest, env: Envelope, st: ChoiceState, chunk: Chunk, first: bool
) -> list[dict[str, Any]]:
    """The OpenAI chunks one engine chunk becomes (a role header first, for chat)."""
    out = []
    ids = req.return_token_ids
    prompt_ids = st.prompt_token_ids if (ids and first) else None
    if first and env.endpoint == "chat":
        out.append(
            stream_chunk(
                env,
                st.index,
                role=True,
                prompt_token_ids=prompt_ids,
                include_usage=req.include_usage,
            )
        )
        prompt_ids = None
    parts = [part for call in chunk.tool_calls for part in tool_call_deltas(call)]
    finish = chunk.finish_reason or None
    if chunk.text or chunk.token_ids or (finish and not parts):
        out.append(
            stream_chunk(
                env,
                st.index,
                text=chunk.text,
                finish_reason=None if parts else finish,
                token_ids=chunk.token_ids if ids else None,
                prompt_token_ids=prompt_ids,
                include_usage=req.include_usage,
            )
        )
    # Tool calls after the text of the same piece, then the finish on its own (as OpenAI).
    for part in parts:
        out.append(stream_chunk(env, st.index, tool_calls=part,
                                include_usage=req.include_usage))
    if parts and finish:
        out.append(stream_chunk(env, st.index, finish_reason=finish,
                                include_usage=req.include_usage))
    return out


async def _stream(
    request: web.Request,
    req: ApiRequest,
    env: Envelope,
    states: dict[int, ChoiceState],
    timing: Timing,
    events: AsyncIterator[tuple[int, Chunk]],
) -> web.StreamResponse:
    # Wait for the first chunk before sending headers, so that failures before any output
    # (bad prompt, no node, unknown model) still get their proper HTTP status.
    first = await anext(events, None)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    if first is not None and first[1].node:
        headers[NODE_HEADER] = first[1].node  # (other choices may run on other nodes)
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    seen: set[int] = set()
    try:
        try:
            item = first
            while item is not None:
                index, chunk = item
                st = states[index]
                st.add(chunk)
                timing.tokens(index, len(chunk.token_ids))
                for obj in _chunk_events(req, env, st, chunk, index not in seen):
                    await resp.write(sse(obj))
                seen.add(index)
                item = await anext(events, None)
        except ApiError as e:
            log.warning("stream %s failed after it started: %s", env.id, e.message)
            await resp.write(sse(e.body()))
        if req.include_usage:
            await resp.write(sse(usage_chunk(env, list(states.values()))))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client of %s disconnected; cancelling its generation", env.id)
        request[CLIENT_GONE] = True
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def list_models(request: web.Request) -> web.Response:
    """Every model a client may ask for: those nodes serve now (``state: active``, on
    ``nodes``) and the catalogue's others (``state: evicted``: the first request activates
    one, waiting for it)."""
    state = request.app[STATE]
    tenant_of(state, request)
    reg = state.registry
    data = []
    for m in reg.models(healthy_only=True):
        nodes = [n.node_id for n in reg.healthy(m.name)]
        data.append(_model_card(m.name, m.max_model_len, "active", nodes,
                                state.dispatcher.catalog.get(m.name)))
    listed = {d["id"] for d in data}
    for entry in state.dispatcher.catalog.values():
        if entry.name not in listed:
            data.append(_model_card(entry.name, 0, "evicted", [], entry))
    return web.json_response({"object": "list", "data": data})


def _model_card(name: str, max_model_len: int, status: str, nodes: list[str],
                entry: ModelEntry | None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                            "owned_by": "overture", "max_model_len": max_model_len,
                            "state": status, "nodes": nodes}
    if entry is not None:
        card.update(ttft_slo_s=entry.ttft_slo_s, tpot_slo_s=entry.tpot_slo_s, pin=entry.pin)
    return card


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app[STATE].limits))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    reg = request.app[STATE].registry
    healthy = reg.healthy()
    body = {
        "ready": bool(healthy),
        "healthy_nodes": [n.node_id for n in healthy],
        "degraded_nodes": [n.node_id for n in healthy if n.load.degraded],
        "nodes": {
            n.node_id: {
                "state": _node_state(reg, n),
                "in_rotation": reg.in_rotation(n),
                "problem": n.load.problem,
                "degraded": n.load.degraded,
                "queue_delay_s": round(n.load.queue_delay_s, 3),
                "running": n.load.running,
                "waiting": n.load.waiting,
                "routed": n.routed,
                "advised": n.advised,
            }
            for n in reg.all()
        },
        "models": [m.name for m in reg.models(healthy_only=True)],
    }
    return web.json_response(body, status=200 if healthy else 503)


def _node_state(reg: NodeRegistry, n: Node) -> str:
    """serving | degraded (serves, a part is down) | drained | down (problem, silent or
    unreachable)."""
    if reg.in_rotation(n):
        return "degraded" if n.load.degraded else "serving"
    if n.drained and reg.alive(n) and not n.load.problem:
        return "drained"
    return "down"


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.keys.check_admin(request.headers.get("Authorization", ""))  # (operators' data)
    state.metrics.sessions.set(len(state.dispatcher.sessions))
    text = state.metrics.render(state.registry)
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE})


def build_app(state: ApiState) -> web.Application:
    # aiohttp enforces the body limit itself for bodies without a Content-Length.
    app = web.Application(middlewares=[_errors], client_max_size=state.max_body_bytes)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    add_admin_routes(app)
    add_advisory_routes(app)
    add_responses_routes(app)
    add_static_routes(app)
    return app
