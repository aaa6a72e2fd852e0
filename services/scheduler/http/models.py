"""``GET /v1/models``: the models a client may ask for, active on nodes or waiting in the
catalogue to be activated by their first request."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.scheduler.http.state import STATE, tenant_of
from shared.model_catalog import ModelEntry


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


def add_model_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
