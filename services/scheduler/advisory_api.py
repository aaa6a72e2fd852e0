"""The advisory routes (Symphony §3.3; DESIGN §4).

    POST   /v1/advisory        {session_id, model, expected_arrival_s?, priority?,
                                successors?: [{session_id, model, expected_arrival_s?}]}
                               -> 202 {advisory_id, node, expires_at, successors: [...]}
    DELETE /v1/advisory/{id}   -> 200 {id, object: "advisory", deleted: true}

A chat client sends one when its user starts typing; an agent framework names the agents
that may run next as ``successors`` (each advised on its own). The tenant comes from the
API key as for inference; errors have OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.scheduler.advisor import AdviceAsked, Advisor
from services.scheduler.advisories import Advisory
from services.scheduler.errors import ApiError, invalid
from services.scheduler.validation import parse_json

if TYPE_CHECKING:
    from services.scheduler.http_api import ApiState

MAX_SESSION_ID = 256
MAX_SUCCESSORS = 16
MAX_ARRIVAL_S = 3600.0
FIELDS = {"session_id", "model", "expected_arrival_s", "priority", "successors"}
SUCCESSOR_FIELDS = {"session_id", "model", "expected_arrival_s"}


def _asked(body: Any, state: ApiState, where: str, fields: set[str]) -> AdviceAsked:
    if not isinstance(body, dict):
        raise invalid(f"{where} must be a JSON object", where or None, "invalid_type")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(f"unknown field '{where}{unknown[0]}'", f"{where}{unknown[0]}",
                      "unknown_field")
    session = body.get("session_id")
    if not isinstance(session, str) or not session.strip():
        raise invalid(f"'{where}session_id' is required: a non-empty string",
                      f"{where}session_id", "invalid_session_id")
    if len(session) > MAX_SESSION_ID or "/" in session or not session.isprintable():
        raise invalid(f"'{where}session_id' must be at most {MAX_SESSION_ID} printable "
                      "characters without '/'", f"{where}session_id", "invalid_session_id")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(f"'{where}model' is required: a model name", f"{where}model",
                      "invalid_type")
    if not any(n.serves(model) for n in state.registry.all()):
        known = ", ".join(m.name for m in state.registry.models(healthy_only=False)) or "none"
        raise ApiError(404, f"The model '{model}' does not exist; served models: {known}",
                       param=f"{where}model", code="model_not_found")
    arrival = body.get("expected_arrival_s", 0.0)
    if (isinstance(arrival, bool) or not isinstance(arrival, int | float)
            or not 0.0 <= arrival <= MAX_ARRIVAL_S):
        raise invalid(f"'{where}expected_arrival_s' must be a number of seconds from 0 to "
                      f"{MAX_ARRIVAL_S:g}, got {json.dumps(arrival)}",
                      f"{where}expected_arrival_s", "invalid_value")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 1000:
        raise invalid(f"'{where}priority' must be an integer from -1000 to 1000, got "
                      f"{json.dumps(priority)}", f"{where}priority", "invalid_value")
    return AdviceAsked(session, model, float(arrival), priority)


def _view(adv: Advisory) -> dict[str, Any]:
    return {"advisory_id": adv.advisory_id, "object": "advisory", "session_id": adv.session_id,
            "node": adv.node_id, "expires_at": round(adv.wall_expires_at, 3)}


async def create(request: web.Request) -> web.Response:
    from services.scheduler.http_api import STATE, read_body, tenant_of

    state = request.app[STATE]
    tenant = tenant_of(state, request)
    state.tenants.advisory(tenant)
    body = parse_json(await read_body(state, request))
    asked = _asked(body, state, "", FIELDS)
    successors = body.get("successors", [])
    if not isinstance(successors, list) or len(successors) > MAX_SUCCESSORS:
        raise invalid(f"'successors' must be a list of at most {MAX_SUCCESSORS} objects",
                      "successors", "invalid_type")
    nexts = [_asked(s, state, f"successors[{i}].", SUCCESSOR_FIELDS)
             for i, s in enumerate(successors)]
    sessions = [asked.session_id, *(s.session_id for s in nexts)]
    if len(set(sessions)) != len(sessions):
        raise invalid("each advised session may appear once (in session_id and successors)",
                      "successors", "duplicate_session")
    advisor: Advisor = state.advisor
    advisor.check_throttle(tenant, len(sessions))
    adv = advisor.advise(tenant, asked)
    answer = _view(adv)
    answer["successors"] = [_view(advisor.advise(tenant, s)) for s in nexts]
    return web.json_response(answer, status=202)


async def delete(request: web.Request) -> web.Response:
    from services.scheduler.http_api import STATE, tenant_of

    state = request.app[STATE]
    tenant = tenant_of(state, request)
    adv = state.advisor.invalidate(tenant, request.match_info["advisory_id"])
    return web.json_response({"id": adv.advisory_id, "object": "advisory", "deleted": True})


def add_advisory_routes(app: web.Application) -> None:
    app.router.add_post("/v1/advisory", create)
    app.router.add_delete("/v1/advisory/{advisory_id}", delete)
