"""Operator routes: drain a node (its sessions move off it with their KV) and see where a
session's KV is.

    POST /admin/nodes/{id}/drain     no new requests to the node; it keeps serving its
    POST /admin/nodes/{id}/undrain   peers' pulls, so a rolling upgrade loses no session
    GET  /admin/nodes                every node: rotation, drained, load, kvstore
    GET  /admin/sessions/{id}?tenant=T   the node of the session's last turn and its tokens

These need ``Authorization: Bearer`` with one of ``scheduler.admin_keys``
(``tenants/keys.py``); in anonymous mode (a local cluster) they are open.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from services.scheduler.api import ApiError
from services.scheduler.cluster import Node, NodeRegistry
from services.scheduler.http.state import STATE, ApiState

log = logging.getLogger(__name__)


def _state(request: web.Request) -> ApiState:
    state = request.app[STATE]
    _check_admin(state, request)
    return state


def _check_admin(state: ApiState, request: web.Request) -> None:
    state.keys.check_admin(request.headers.get("Authorization", ""))


def _node(registry: NodeRegistry, request: web.Request) -> Node:
    node_id = request.match_info["node_id"]
    node = registry.get(node_id)
    if node is None:
        known = ", ".join(n.node_id for n in registry.all()) or "none"
        raise ApiError(404, f"no node '{node_id}'; known nodes: {known}", code="node_not_found")
    return node


def _describe(registry: NodeRegistry, n: Node) -> dict[str, Any]:
    return {
        "node": n.node_id,
        "in_rotation": registry.in_rotation(n),
        "alive": registry.alive(n),
        "drained": n.drained,
        "degraded": n.load.degraded,  # a part down but serving (e.g. "... s3 degraded: ...")
        "running": n.load.running,
        "waiting": n.load.waiting,
        "routed": n.routed,
        "kvstore_address": n.info.kvstore_address,
        "models": [m.name for m in n.info.models],
        "metrics": {name: f"http://{addr}/metrics" for name, addr in n.info.metrics},
    }


async def _set_drained(request: web.Request, drained: bool) -> web.Response:
    state = _state(request)
    node = _node(state.registry, request)
    state.registry.drain(node.node_id, drained)
    log.info("node %s %s by an operator", node.node_id, "drained" if drained else "undrained")
    return web.json_response(_describe(state.registry, node))


async def drain(request: web.Request) -> web.Response:
    return await _set_drained(request, True)


async def undrain(request: web.Request) -> web.Response:
    return await _set_drained(request, False)


async def nodes(request: web.Request) -> web.Response:
    state = _state(request)
    reg = state.registry
    return web.json_response({"nodes": [_describe(reg, n) for n in reg.all()]})


async def session(request: web.Request) -> web.Response:
    state = _state(request)
    session_id = request.match_info["session_id"]
    tenant = request.query.get("tenant", "default")
    place = state.dispatcher.sessions.where(tenant, session_id)
    if place is None:
        raise ApiError(404, f"the scheduler does not know where session '{session_id}' of "
                       f"tenant '{tenant}' is (never served, forgotten, or served before a "
                       "restart: its next turn looks in the shared tier)",
                       code="session_not_found")
    node = state.registry.get(place.node_id)
    clock = state.dispatcher.sessions.clock
    return web.json_response({
        "session_id": session_id,
        "tenant": tenant,
        "node": place.node_id,
        "kvstore_address": node.info.kvstore_address if node else "",
        "node_alive": bool(node and state.registry.alive(node)),
        "turn_tokens": place.turn_tokens,
        "saved_tokens": place.saved_tokens,
        "age_s": round(clock() - place.updated, 3),
    })


def add_admin_routes(app: web.Application) -> None:
    app.router.add_post("/admin/nodes/{node_id}/drain", drain)
    app.router.add_post("/admin/nodes/{node_id}/undrain", undrain)
    app.router.add_get("/admin/nodes", nodes)
    app.router.add_get("/admin/sessions/{session_id}", session)
