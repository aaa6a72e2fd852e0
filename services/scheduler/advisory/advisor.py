"""The scheduler's side of advisory requests (Symphony §3.3, §3.6; DESIGN §3, §6).

``advise``: plan the session's next turn now, by the same policy as a request (least
loaded, ties towards the node holding its KV), record the choice, and, as the plan says,
tell that node to prefetch (naming the kvstore that holds the session's KV when it is
another node's, and whether straight into device memory). ``follow``: a request of an
advised session goes to its advisory's node. Ended advisories are counted by how they
ended and teach the throttle which tenants advise uselessly; a replaced, invalidated or
lapsed advisory's prefetch is stopped on its node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.scheduler.advisory.book import (
    CLIENT,
    EXPIRED,
    FOLLOWED,
    INFERRED,
    INVALIDATED,
    Advisory,
    AdvisoryBook,
    TooManyAdvisories,
)
from services.scheduler.advisory.inferred import ToolLatencies
from services.scheduler.advisory.placement import AdvisoryPlacement
from services.scheduler.advisory.throttle import AdvisoryThrottle
from services.scheduler.api import ApiError
from services.scheduler.cluster import (
    InFlight,
    Node,
    NodeChannels,
    NodeRegistry,
    SessionDirectory,
)
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import ActivationQueue
from services.scheduler.routing import Policy
from shared.proto import nodemgr_pb2

log = logging.getLogger(__name__)

NODE_CALL_S = 2.0  # deadline of an Advise / Invalidate call to a node


@dataclass(frozen=True)
class AdviceAsked:
    session_id: str
    model: str
    expected_arrival_s: float = 0.0
    priority: int = 0
    source: str = CLIENT
    tools: tuple[str, ...] = ()  # an inferred advisory's: the tools its session called
    life_s: float = 0.0  # > 0: expires this long from now (else arrival + the book's TTL)


class Advisor:
    def __init__(self, book: AdvisoryBook, throttle: AdvisoryThrottle, registry: NodeRegistry,
                 policy: Policy, channels: NodeChannels, sessions: SessionDirectory,
                 metrics: SchedulerMetrics, catalog: frozenset[str] = frozenset(),
                 inflight: InFlight | None = None,
                 latencies: ToolLatencies | None = None,
                 activations: ActivationQueue | None = None,
                 model_bytes: Callable[[str], int] = lambda _: 0) -> None:
        self.book = book
        self.throttle = throttle
        self.registry = registry
        self.policy = policy
        self.channels = channels
        self.sessions = sessions
        self.metrics = metrics
        self.placement = AdvisoryPlacement(book, registry, policy, sessions, catalog, inflight,
                                           activations, model_bytes)
        self.latencies = latencies  # None: no inferred advisories
        self._calls: set[asyncio.Task[None]] = set()

    def check_throttle(self, tenant: str, count: int = 1) -> None:
        """429 with Retry-After when the tenant's advisories are mostly spurious and its
        allowance (one token per advisory, successors included) is used up, or when it
        has its share of pending advisories."""
        if self.book.pending(tenant) + count > self.book.per_tenant:
            self.metrics.advisories.labels("throttled", CLIENT).inc()
            raise ApiError(429, f"this tenant has {self.book.per_tenant} pending advisories "
                           "already; let some be followed, expire or be invalidated",
                           code="too_many_advisories", headers={"Retry-After": "1"})
        wait = self.throttle.retry_after(tenant, count)
        if wait is not None:
            self.metrics.advisories.labels("throttled", CLIENT).inc()
            raise ApiError(
                429, "most of this tenant's advisories were not followed by a request; "
                f"advisories are limited for now: retry after {wait}s",
                code="advisories_throttled", headers={"Retry-After": str(wait)})

    def advise(self, tenant: str, asked: AdviceAsked) -> Advisory:
        """Choose the node, record the advisory and start the node's prefetch."""
        try:
            placed = self.placement.place(tenant, asked.session_id, asked.model,
                                          asked.priority, asked.expected_arrival_s,
                                          asked.source, asked.tools, asked.life_s)
        except TooManyAdvisories:
            raise ApiError(429, "this tenant has too many pending advisories",
                           code="too_many_advisories", headers={"Retry-After": "1"}) from None
        if placed is None:
            raise ApiError(503, f"no healthy node serves model '{asked.model}' now",
                           code="no_healthy_node")
        adv, node = placed.advisory, placed.node
        self.metrics.advisories.labels("received", asked.source).inc()
        for old, how in placed.ended:
            # (replaced on the same node: the new advisory's prefetch renews the session's)
            self._ended(old, how, tell_node=old.node_id != node.node_id)
        if not placed.plan.prefetch:  # (a baseline: the advisory is only recorded)
            return adv
        if placed.warm is not None:  # (the node activates the model first: Advise)
            self.metrics.affinity_choices.labels("advisory", placed.warm.reuse).inc()
        source = placed.source
        self._call(node, "Advise", nodemgr_pb2.AdviseRequest(
            advisory_id=adv.advisory_id, tenant=tenant, session_id=asked.session_id,
            model=asked.model, kv_source=source.info.kvstore_address if source else "",
            kv_tokens=placed.kv_tokens, priority=asked.priority,
            ttl_s=max(0.0, adv.expires_at - self.book.clock()),
            straight_to_device=placed.plan.straight_to_device))
        log.info("advisory %s: session %s of %s goes to %s (KV %s)", adv.advisory_id,
                 asked.session_id, tenant, node.node_id,
                 f"from {source.node_id}" if source else "from its tiers or S3")
        return adv

    def invalidate(self, tenant: str, advisory_id: str) -> Advisory:
        adv = self.placement.invalidate(tenant, advisory_id)
        if adv is None and self.book.made_before_restart(advisory_id):
            raise ApiError(404, f"advisory '{advisory_id}' was made by a scheduler that has "
                           "restarted (or handed over) since: pending advisories end with "
                           "it, so the session's next request is served unadvised; advise "
                           "again if it is still to come", param="advisory_id",
                           code="advisory_lost_in_restart")
        if adv is None:
            raise ApiError(404, f"no pending advisory '{advisory_id}' (unknown, expired, "
                           "followed, or another tenant's)", param="advisory_id",
                           code="advisory_not_found")
        self._ended(adv, INVALIDATED)
        return adv

    def advised(self, tenant: str, session_id: str) -> str:
        """The node the session's pending advisory chose ("": none, or it lapsed). The
        advisory stays pending until ``follow``: a request refused before it found a node
        (every node at capacity) leaves it for the client's retry."""
        adv = self.book.pending_for(tenant, session_id)
        return adv.node_id if adv is not None else ""

    def follow(self, tenant: str, session_id: str) -> str:
        """The node an advised request goes to ("" when its session had no advisory, or
        it lapsed: a late request is routed as if unadvised, and not held against its
        tenant)."""
        adv, how = self.placement.follow(tenant, session_id)
        if adv is None:
            return ""
        gap = max(0.0, self.book.clock() - adv.created)
        if adv.source == INFERRED and self.latencies is not None:
            self.latencies.observe(tenant, adv.tools, gap)  # (a late one teaches too)
        self.metrics.advisories.labels(how, adv.source).inc()
        if how != FOLLOWED:
            return ""
        self.metrics.advisory_lead_time.observe(gap)
        if adv.source == CLIENT:
            self.throttle.outcome(tenant, True)
        return adv.node_id

    def infer(self, tenant: str, session_id: str, model: str, tools: tuple[str, ...],
              priority: int) -> None:
        """The session's turn ended calling ``tools``: advise its next turn, expected after
        the tools' learnt latency (``inferred.py``). A client's own pending advisory for
        the session takes precedence; a full book or no node skips it (a hint only)."""
        if self.latencies is None or not session_id:
            return
        pending = self.book.pending_for(tenant, session_id)
        if pending is not None and pending.source == CLIENT:
            return
        expected = self.latencies.expected(tenant, tools)
        try:
            self.advise(tenant, AdviceAsked(session_id, model, expected.arrival_s, priority,
                                            INFERRED, tools, expected.expiry_s))
        except ApiError as e:
            log.info("no inferred advisory for session %s of %s: %s", session_id, tenant,
                     e.message)

    def sweep(self) -> None:
        for adv in self.placement.sweep():
            self._ended(adv, EXPIRED)

    def _ended(self, adv: Advisory, how: str, tell_node: bool = True) -> None:
        self.metrics.advisories.labels(how, adv.source).inc()
        if how == EXPIRED and adv.source == CLIENT:  # (an abandoned tool loop is no fault)
            self.throttle.outcome(adv.tenant, False)
        node = self.registry.get(adv.node_id)
        if node is not None and adv.prefetch and tell_node:
            self._call(node, "Invalidate", nodemgr_pb2.InvalidateRequest(
                advisory_id=adv.advisory_id, expired=how == EXPIRED))

    def _call(self, node: Node, method: str, request: object) -> None:
        """Send ``request`` to the node in the background (a slow node delays no client)."""
        async def call() -> None:
            try:
                await getattr(self.channels.stub(node.info.address), method)(
                    request, timeout=NODE_CALL_S)
            except grpc.aio.AioRpcError as e:
                log.warning("%s to node %s failed: %s %s", method, node.node_id,
                            e.code().name, e.details())

        task = asyncio.create_task(call())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def run_sweeper(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    async def close(self) -> None:
        for t in list(self._calls):
            t.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
