"""How the service and its nodes are doing: ``/healthz`` (the process answers),
``/readyz`` (a node is in rotation; every node's state and load), ``/leaderz`` (this
replica is the one that serves: the Kubernetes readiness probe) and ``/metrics``
(Prometheus text, for admin keys)."""

from __future__ import annotations

from aiohttp import web

from services.scheduler.cluster import Node, NodeRegistry
from services.scheduler.http.state import STATE
from services.scheduler.metrics import CONTENT_TYPE


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def leaderz(request: web.Request) -> web.Response:
    leader = request.app[STATE].leader()
    return web.json_response({"leader": leader}, status=200 if leader else 503)


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


def add_health_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/leaderz", leaderz)
    app.router.add_get("/metrics", metrics)
