"""A generation's request as its node gets it, carrying out the route plan's KV half:
marked to reuse no KV at all, or only its node's device cache, or naming the kvstore
that holds the session's KV when that is another node's and that node is alive (a
drained one counts: it still serves pulls). Otherwise the node looks in its own tiers and
the shared S3 tier, then recomputes."""

from __future__ import annotations

import logging

from services.scheduler import wire
from services.scheduler.cluster import HOLDER_SLACK, NodeRegistry, SessionPlace
from services.scheduler.routing.plan import RoutePlan
from shared.proto import common_pb2

log = logging.getLogger(__name__)


def node_request(request: common_pb2.GenerateRequest, plan: RoutePlan,
                 place: SessionPlace | None, registry: NodeRegistry
                 ) -> common_pb2.GenerateRequest:
    """``request`` for ``plan.node``; ``place`` is where the session's KV is (its last
    turn's length is what the node's peer waits to have saved)."""
    if not plan.reuse_kv:
        return wire.without_reuse(request)
    if plan.device_only:
        return wire.device_only(request)
    if not plan.pull_from or place is None:
        return request
    holder = registry.get(plan.pull_from)
    if holder is None or not holder.info.kvstore_address:
        return request  # the serving node looks in its own tiers and S3
    # (a holder whose heartbeat is merely late, a busy host, is still asked)
    if not registry.alive(holder, slack=HOLDER_SLACK):
        log.info("the KV of a session is on node %s, silent for %.1fs or unreachable: "
                 "node %s looks in its own tiers and S3", holder.node_id,
                 registry.silent_s(holder), plan.node.node_id)
        return request
    tokens = place.turn_tokens or place.saved_tokens
    return wire.with_kv_source(request, holder.info.kvstore_address, tokens)
