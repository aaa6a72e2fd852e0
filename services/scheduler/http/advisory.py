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

from typing import Any

from aiohttp import web

from services.scheduler.advisory import AdviceAsked, Advisor, Advisory
from services.scheduler.api import ADVISORY, ApiError, invalid, parse_json
from services.scheduler.http.state import STATE, ApiState, read_body, tenant_of


def _asked(v: dict[str, Any], state: ApiState, where: str) -> AdviceAsked:
    """A checked advisory (or successor) object as the advisor takes it; 404 for a model
    neither a node serves nor the catalogue lists (an evicted one is activated)."""
    model = v["model"]
    if not state.dispatcher.known_model(model):
        known = ", ".join(m.name for m in state.registry.models(healthy_only=False)) or "none"
        raise ApiError(404, f"The model '{model}' does not exist; served models: {known}",
                       param=f"{where}model", code="model_not_found")
    return AdviceAsked(v["session_id"], model, v.get("expected_arrival_s", 0.0),
                       v.get("priority", 0))


def _view(adv: Advisory) -> dict[str, Any]:
    return {"advisory_id": adv.advisory_id, "object": "advisory", "session_id": adv.session_id,
            "node": adv.node_id, "expires_at": round(adv.wall_expires_at, 3)}


async def create(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    state.tenants.advisory(tenant)
    v = ADVISORY.check(parse_json(await read_body(state, request, tenant)))
    asked = _asked(v, state, "")
    nexts = [_asked(s, state, f"successors[{i}].") for i, s in enumerate(v.get("successors", []))]
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
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    adv = state.advisor.invalidate(tenant, request.match_info["advisory_id"])
    return web.json_response({"id": adv.advisory_id, "object": "advisory", "deleted": True})


def add_advisory_routes(app: web.Application) -> None:
    app.router.add_post("/v1/advisory", create)
    app.router.add_delete("/v1/advisory/{advisory_id}", delete)
