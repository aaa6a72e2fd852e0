"""What every route shares: the app's typed state (``ApiState`` under the app key
``STATE``), the caller's tenant, and the request body read within its limits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from services.scheduler.advisory import Advisor
from services.scheduler.api import ApiError, Limits, Message, check_body_size
from services.scheduler.cluster import NodeRegistry
from services.scheduler.http.body_budget import BodyBudget
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.responses import ResponseStore
from services.scheduler.routing import Dispatcher
from services.scheduler.tenants import TOKEN_HEADER, KeyBook, TenantLimits, Turns


@dataclass
class ApiState:
    """The scheduler's parts as the routes use them (built by ``app.build_state``)."""

    registry: NodeRegistry
    dispatcher: Dispatcher
    metrics: SchedulerMetrics
    limits: Limits
    keys: KeyBook
    max_body_bytes: int
    advisor: Advisor
    tenants: TenantLimits = field(default_factory=lambda: TenantLimits(0, 0, 0))
    body_timeout_s: float = 30.0
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(3600.0, 10_000))
    # Whether this replica is the one that serves (scheduler/lease.py; always without one).
    leader: Callable[[], bool] = field(default=lambda: True)
    session_headers: tuple[str, ...] = ()  # read after X-Session-Id (agent CLIs' own)
    turns: Turns = field(default_factory=lambda: Turns(1))
    bodies: BodyBudget = field(default_factory=lambda: BodyBudget(0, 4 << 20))


STATE = web.AppKey("state", ApiState)
CLIENT_GONE = "overture.client_gone"  # request key: the client left mid-stream (counted as 499)
NODE_HEADER = "X-Overture-Node"  # the node that served a generation
IGNORED_HEADER = "X-Overture-Ignored-Fields"  # request fields ignored, comma-separated
MAX_TOKEN_CHARS = 256  # a retry token sent back (a session id at most)


def tenant_of(state: ApiState, request: web.Request) -> str:
    """The tenant of the request's API key (401 without a known one)."""
    return state.keys.tenant_of(request.headers.get("Authorization", ""))


def session_header(state: ApiState, request: web.Request) -> str:
    """The session a header names: ``X-Session-Id``, else the first of the configured
    headers agent CLIs send (``scheduler.session_headers``); "" for none."""
    for name in ("X-Session-Id", *state.session_headers):
        if value := request.headers.get(name, ""):
            return value
    return ""


def call_session(state: ApiState, tenant: str, messages: Sequence[Message],
                 offers_tools: bool, new_session: str) -> str:
    """The session of a request that names none: the one whose tool calls its history
    answers (``cluster/tool_calls.py``), else ``new_session`` when it offers tools (its
    calls will name it), else ""."""
    ids = [i for m in messages for i in (m.tool_call_id, *(c.id for c in m.tool_calls)) if i]
    found = state.dispatcher.tool_sessions.session_of(tenant, ids)
    return found or (new_session if offers_tools else "")


def retry_key(request: web.Request, session: str) -> str:
    """What identifies a client's retries (``tenants/turns.py``): the retry token its
    last 429 gave it, else the request's session ("" if neither)."""
    token = request.headers.get(TOKEN_HEADER, "")
    return token if 0 < len(token) <= MAX_TOKEN_CHARS and token.isprintable() else session


async def read_body(state: ApiState, request: web.Request, tenant: str) -> bytes:
    """The whole body, within the size limit, ``tenant``'s bytes being read at once
    (``body_budget.py``) and ``body_timeout_s`` (a client trickling its upload holds no
    memory and no connection for long: after its 408 the connection is closed)."""
    check_body_size(request.content_length, state.max_body_bytes)
    with state.bodies.reading(tenant, request.content_length):
        try:
            async with asyncio.timeout(state.body_timeout_s):
                return await request.read()
        except TimeoutError:
            pass
    state.bodies.stalled()
    raise ApiError(408, f"the request body did not arrive within {state.body_timeout_s:g} s",
                   code="body_timeout", headers={"Connection": "close"})
