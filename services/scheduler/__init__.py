"""Scheduler: the public OpenAI-compatible API in front of the cluster, and the cluster's
node registry (DESIGN §3, §6).

    http/        the aiohttp app, its state and routes, the hardened server
    api/         the public API as data: bodies, validation, OpenAPI, output shapes, errors
    routing/     the policies and their plans, the dispatcher, the fan-out of choices
    advisory/    pending advisories, their placement, the throttle, the advisor
    cluster/     the nodes and their load, where each session's KV is, the node channels
    placement/   which node each catalogue model runs on (Prism Algorithm 1)
    tenants/     API and admin keys, per-tenant limits
    responses/   the Responses API's store and items
    app.py       the process: builds the parts, starts the servers and loops (``run``)
    grpc_service.py  node registration and heartbeats; wire.py  protobuf <-> dataclasses
"""

from services.scheduler.app import run
from services.scheduler.config import SchedulerConfig

__all__ = ["SchedulerConfig", "run"]
