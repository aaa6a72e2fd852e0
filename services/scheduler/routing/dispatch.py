"""Route one generation to a node and stream its chunks back, mapping node failures to
``ApiError``s.

The policy's ``RoutePlan`` says where and what to do with the session's KV; the request
is sent as the plan says (``kv_source.node_request``). Under a policy whose KV follows the
session, a node other than the one that served its last turn is told that node's kvstore
(and the turn's length), and pulls the KV from there layer by layer (Symphony §3.2–3.3).
A turn that ends records its node in the ``SessionDirectory``.

Faults and overload: a node that refuses a request as behind is skipped by it and by later
ones for ``behind_hold_s``; when every node is behind or its admission window full, 429
with ``Retry-After`` at once. A node silent (not even keepalives) for
``stream_idle_timeout_s`` is a hung host: its streams are cut with a clean error and it
leaves rotation until it beats again. A failure before the first token (``NODE_FAILURES``:
the engine broke, the request is fine) is retried once on another node; after it, the
stream ends with an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.scheduler import wire
from services.scheduler.api import ApiError, Chunk, from_grpc
from services.scheduler.cluster import (
    InFlight,
    NodeChannels,
    NodeRegistry,
    PrefixIndex,
    SessionDirectory,
    ToolCallSessions,
    request_hashes,
)
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import ActivationQueue, ModelRates
from services.scheduler.routing.kv_source import node_request
from services.scheduler.routing.plan import RoutePlan, RouteRequest
from services.scheduler.routing.policy import Policy
from services.scheduler.routing.window import NodeWindows, WindowSettings
from shared.model_catalog import ModelEntry, weight_bytes_of
from shared.proto import common_pb2

log = logging.getLogger(__name__)

# Statuses that say the node or its engine broke under the request, not that the request is
# wrong or the cluster full: before any output, the request is retried once elsewhere.
NODE_FAILURES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
                           grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class DispatchSettings:
    no_node_wait_s: float = 2.0
    unavailable_retries: int = 2
    suspend_grace_s: float = 1.0
    request_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 10.0
    retry_after_s: int = 1
    behind_hold_s: float = 0.25


class Advisories(Protocol):
    """The advisor as the dispatcher sees it (``advisory/advisor.py``)."""

    def advised(self, tenant: str, session_id: str) -> str:
        """The node the session's pending advisory chose ("": none); it stays pending."""
        ...

    def follow(self, tenant: str, session_id: str) -> str:
        """End the session's advisory as followed; the node it chose ("": none, or lapsed)."""
        ...

    def infer(self, tenant: str, session_id: str, model: str, tools: tuple[str, ...],
              priority: int) -> None:
        """The session's turn ended calling ``tools``: its next turn (their results) is
        coming, so the scheduler advises it itself (``advisory/inferred.py``)."""
        ...


class NodeStalled(Exception):
    """The node sent nothing within the inactivity bound."""


class Dispatcher:
    def __init__(
        self,
        registry: NodeRegistry,
        policy: Policy,
        channels: NodeChannels,
        settings: DispatchSettings,
        sessions: SessionDirectory | None = None,
        metrics: SchedulerMetrics | None = None,
        advisor: Advisories | None = None,
        catalog: tuple[ModelEntry, ...] = (),
        inflight: InFlight | None = None,
        prefixes: PrefixIndex | None = None,
        prefix_index: PrefixIndex | None = None,
        windows: NodeWindows | None = None,
        activations: ActivationQueue | None = None,
    ) -> None:
        self.registry = registry
        # The generations running, to place advisories by the load at their arrival.
        self.inflight = inflight if inflight is not None else InFlight()
        self.windows = windows or NodeWindows(WindowSettings(), self.inflight)  # (off)
        self.prefixes = prefixes if prefixes is not None else PrefixIndex(100_000)
        self.tool_sessions = ToolCallSessions()  # call id -> the session that made it
        # Models the cluster may serve though no node runs them now (shared/model_catalog).
        self.catalog = {m.name: m for m in catalog}
        self._catalog_bytes = weight_bytes_of(catalog)
        self.rates = ModelRates()  # requests per model (the placement's r_j)
        # Evicted models' requests and advisories (Tangram §3.4): one queue for both.
        self.activations = activations if activations is not None else ActivationQueue()
        self.policy = policy
        self.channels = channels
        self.settings = settings
        self.sessions = sessions if sessions is not None else SessionDirectory(100_000, 86400.0)
        self.metrics = metrics
        self.advisor = advisor
        # Which node's device holds which prompt prefixes (the ``prefix`` policy only).
        self.prefix_index = prefix_index

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    async def resolve_model(self, model: str | None) -> str:
        """The model a request names, or the cluster's default when it names none."""
        if model is not None:
            return model
        deadline = self._loop_time() + self.settings.no_node_wait_s
        while True:
            specs = self.registry.models(healthy_only=True)
            if specs:
                return specs[0].name
            remaining = deadline - self._loop_time()
            if remaining <= 0:
                raise self._unavailable(None)
            await self.registry.wait_changed(remaining)

    async def pick(self, route: RouteRequest, behind: frozenset[str] = frozenset(),
                   failed: frozenset[str] = frozenset()) -> RoutePlan:
        """The policy's plan on a healthy node for ``route.model`` other than those that
        ``failed`` this request; waits up to ``no_node_wait_s`` for one.

        Raises 404 at once when healthy nodes exist and none of the registered nodes serve
        the model; 429 when every healthy one is in ``behind`` (refused this request as
        overloaded); 503 when the wait ends without a healthy node for it.
        """
        deadline = self._loop_time() + self.settings.no_node_wait_s
        while True:
            healthy = [n for n in self.registry.healthy(route.model)
                       if n.node_id not in failed]
            evicted = not healthy and route.model in self.catalog
            if evicted:  # a catalogue model active nowhere: any node activates it
                healthy = self.registry.healthy()
            free = [n for n in healthy
                    if n.node_id not in behind and not self.registry.behind(n)]
            roomy = self.windows.with_room(free)  # (refused here, not queued in the hops)
            if healthy and not roomy:
                raise self.overloaded(route.model, "window_full" if free else "node_behind")
            free = roomy
            if evicted:  # Algorithm 2 over the queue of activations (Tangram §3.4)
                chosen = self.activations.choose(
                    route.model, free, self.catalog_bytes, lambda m: bool(
                        self.registry.healthy(m)), wait=deadline - self._loop_time()
                    > self.settings.no_node_wait_s / 2)
                free = [chosen.node] if chosen is not None else []
                if chosen is not None and self.metrics is not None:
                    self.metrics.affinity_choices.labels("request", chosen.reuse).inc()
            # (generations that ended since a node's last beat are not its load)
            plan = self.policy.route(free, dataclasses.replace(
                route, gone=self.inflight.gone(free)))
            if plan is not None:
                return plan
            known = any(n.serves(route.model) for n in self.registry.all())
            if not known and route.model not in self.catalog and self.registry.healthy():
                raise _model_not_found(route.model, self.registry)
            remaining = deadline - self._loop_time()
            if remaining <= 0:
                raise self._unavailable(route.model)
            await self.registry.wait_changed(remaining)

    def catalog_bytes(self, model: str) -> int:
        """The model's weight bytes as the catalogue's files say (0: not readable here; the
        nodes' residency reports say it then)."""
        return self._catalog_bytes(model)

    def known_model(self, model: str) -> bool:
        return model in self.catalog or any(n.serves(model) for n in self.registry.all())

    def overloaded(self, model: str, reason: str) -> ApiError:
        """The 429 of every node serving ``model`` (""; any model) full or behind."""
        if self.metrics is not None:
            self.metrics.overloaded.inc()
            self.metrics.admission_refusals.labels(reason).inc()
        wait = self.settings.retry_after_s
        what = "has its admission window full" if reason == "window_full" else "is at capacity"
        nodes = f"every node serving model '{model}'" if model else "every node"
        return ApiError(429, f"{nodes} {what}; retry after {wait}s",
                        code="overloaded", headers={"Retry-After": str(wait)})

    def _unavailable(self, model: str | None) -> ApiError:
        down = [
            f"{n.node_id}: {n.load.problem or ('suspended' if n.suspended else 'no heartbeat')}"
            for n in self.registry.all()
            if model is None or n.serves(model)
        ]
        what = f"model '{model}'" if model else "any model"
        detail = f" ({'; '.join(down)})" if down else " (no node has registered)"
        return ApiError(
            503,
            f"no healthy node serves {what} after waiting "
            f"{self.settings.no_node_wait_s:g}s{detail}",
            code="no_healthy_node",
        )

    def advised_node(self, tenant: str, session_id: str) -> str:
        """The node the session's pending advisory chose ("": no advisory). It ends, as
        followed, once a node takes the request (``generate``)."""
        if self.advisor is None or not session_id:
            return ""
        return self.advisor.advised(tenant, session_id)

    async def generate(
        self, request: common_pb2.GenerateRequest, route: RouteRequest
    ) -> AsyncGenerator[Chunk, None]:
        """Stream the chunks of one generation; re-route while nothing has been produced.

        Closing the iterator (or cancelling its consumer) cancels the gRPC call, which the
        node forwards to its engine.
        """
        retries = self.settings.unavailable_retries
        self.rates.record(route.model)
        place = self.sessions.where(route.tenant, route.session_id) if route.session_id else None
        if place is not None:
            route = dataclasses.replace(route, holder=place.node_id,
                                        holder_tokens=place.turn_tokens)
        hashes: tuple[bytes, ...] = ()
        if self.prefix_index is not None:
            hashes = request_hashes(request)
            route = dataclasses.replace(route, prefix_hits=tuple(self.prefix_index.matches(
                (n.node_id for n in self.registry.all()), hashes).items()))
        if place is None and route.prefix:  # a new session: the nodes holding its context
            route = dataclasses.replace(route, prefix_nodes=self.prefixes.holders(route.prefix))
        behind: set[str] = set()  # nodes that refused this request as overloaded
        failed: set[str] = set()  # nodes whose engine failed it before its first token
        while True:
            plan = await self.pick(route, frozenset(behind), frozenset(failed))
            node = plan.node
            if self.advisor is not None and route.session_id:
                # (once per request: the other choices of an n > 1 request find it ended)
                self.advisor.follow(route.tenant, route.session_id)
            self.registry.begin(node.node_id)
            ticket = self.inflight.begin(node.node_id, request.sampling.max_tokens)
            # What it waited so far (routing, nodes that refused it) is taken off the
            # engine's queue limit: the limit runs from its arrival here.
            sent, sent_wall = time.monotonic(), time.time()
            request.waited_ms = round(max(0.0, sent - (route.arrived or sent)) * 1000)
            request.sent_us = round(sent_wall * 1e6)
            call = self.channels.stub(node.info.address).Generate(
                node_request(request, plan, place, self.registry),
                timeout=self.settings.request_timeout_s,
            )
            produced = False
            last: Chunk | None = None
            calls: list[tuple[str, str]] = []  # (id, function) of the turn's tool calls
            try:
                while (msg := await self._next(call)) is not None:
                    last = wire.chunk(msg, node.node_id)
                    self.inflight.progress(ticket, len(last.token_ids))
                    calls.extend((c.id, c.name) for c in last.tool_calls if c.name)
                    if not produced:  # (a step of the node's admission window)
                        self.windows.first_token(node.node_id, route.arrived)
                    if not produced and self.metrics is not None:
                        self.metrics.turns.labels(last.kv_from or "unknown").inc()
                        self._stages(route.arrived, sent, sent_wall, msg)
                    produced = True
                    if last.finish_reason and route.session_id:
                        # Before the client sees the end: its next turn may come at once
                        # (and must know where this one's KV is).
                        self.sessions.turn_served(route.tenant, route.session_id,
                                                  node.node_id,
                                                  last.prompt_tokens + last.completion_tokens)
                        self._turn_ended(route, ticket, node.node_id, last.finish_reason, calls)
                        ticket = 0
                    if last.finish_reason and self.prefix_index is not None:
                        self.prefix_index.served(node.node_id, hashes)
                    yield last
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not produced:
                    behind.add(node.node_id)  # try the others; 429 once all are behind
                    self.registry.mark_behind(node.node_id, self.settings.behind_hold_s)
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    log.warning(
                        "node %s unreachable (%s); taking it out of rotation",
                        node.node_id,
                        e.details(),
                    )
                    self.registry.suspend(node.node_id, self.settings.suspend_grace_s)
                    if not produced and retries > 0:
                        retries -= 1
                        continue
                elif (e.code() in NODE_FAILURES and not produced and not failed
                      and self._elsewhere(route.model, node.node_id)):
                    log.warning("node %s failed a request before its first token (%s %s); "
                                "retrying it once on another node", node.node_id,
                                e.code().name, e.details())
                    failed.add(node.node_id)
                    if self.metrics is not None:
                        self.metrics.retried.inc()
                    continue
                raise from_grpc(e.code(), e.details(), node.node_id) from None
            except NodeStalled:
                idle = self.settings.stream_idle_timeout_s
                log.error("node %s sent nothing for %gs; cutting its stream and taking it out "
                          "of rotation until it beats again", node.node_id, idle)
                self.registry.suspend(node.node_id, self.settings.suspend_grace_s)
                if self.metrics is not None:
                    self.metrics.stalled.labels(node.node_id).inc()
                if not produced and retries > 0:
                    retries -= 1
                    continue
                raise ApiError(
                    503, f"node {node.node_id} stopped answering (nothing for {idle:g}s)",
                    code="node_stalled",
                ) from None
            finally:
                call.cancel()
                if ticket:
                    self.inflight.end(ticket)
                    self.registry.end(node.node_id)

    def _stages(self, arrived: float, sent: float, sent_wall: float,
                first: common_pb2.GenerateChunk) -> None:
        """Where the time to this first token went (a chunk without ``engine_wait_ms`` is
        from an older engine: not counted). The way to the engine is told apart from the
        way back by the engine's wall clock (as far as the hosts' clocks agree)."""
        if self.metrics is None or not first.engine_wait_ms or not arrived:
            return
        engine = first.engine_wait_ms / 1000
        hops = max(0.0, time.monotonic() - sent - engine)
        there = min(hops, max(0.0, first.engine_received_us / 1e6 - sent_wall))
        stage = self.metrics.first_token_stage
        stage.labels("scheduler").observe(sent - arrived)
        stage.labels("to_engine").observe(there)
        stage.labels("engine").observe(engine)
        stage.labels("back").observe(hops - there)

    def _turn_ended(self, route: RouteRequest, ticket: int, node_id: str, finish: str,
                    calls: list[tuple[str, str]]) -> None:
        """The turn no longer loads its node; the node holds its leading context now; a
        turn that ends calling tools announces the session's next one (Symphony §3.5)."""
        self.inflight.end(ticket)
        self.registry.end(node_id)
        self.prefixes.turn_ended(route.tenant, route.session_id, route.prefix, node_id)
        self.tool_sessions.record(route.tenant, (i for i, _ in calls), route.session_id)
        if finish == "tool_calls" and self.advisor is not None:
            self.advisor.infer(route.tenant, route.session_id, route.model,
                               tuple(dict.fromkeys(n for _, n in calls)), route.priority)

    def _elsewhere(self, model: str, node_id: str) -> bool:
        """Whether a healthy node other than ``node_id`` serves ``model``."""
        return any(n.node_id != node_id for n in self.registry.healthy(model))

    async def _next(self, call: grpc.aio.UnaryStreamCall) -> common_pb2.GenerateChunk | None:
        """The call's next chunk that is not a keepalive (None at its end). Raises
        NodeStalled when nothing, keepalives included, comes within the inactivity bound."""
        while True:
            try:
                async with asyncio.timeout(self.settings.stream_idle_timeout_s):
                    msg = await call.read()  # (a timeout cancels the whole call: fine here)
            except TimeoutError:
                raise NodeStalled() from None
            if msg is grpc.aio.EOF:
                return None
            if not msg.keepalive:
                chunk: common_pb2.GenerateChunk = msg
                return chunk


def _model_not_found(model: str, registry: NodeRegistry) -> ApiError:
    known = ", ".join(m.name for m in registry.models(healthy_only=False)) or "none"
    return ApiError(
        404,
        f"The model '{model}' does not exist; served models: {known}",
        param="model",
        code="model_not_found",
    )
