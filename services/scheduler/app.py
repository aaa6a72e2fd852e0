"""``run(config)``: the scheduler process — public HTTP API plus the Scheduler gRPC server."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from services.scheduler.advisory import Advisor, AdvisoryBook, AdvisoryThrottle, ToolLatencies
from services.scheduler.api import Limits
from services.scheduler.cluster import (
    InFlight,
    NodeChannels,
    NodeRegistry,
    PrefixIndex,
    SessionDirectory,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.grpc_service import SchedulerServicer
from services.scheduler.http import ApiState, BodyBudget, HardenedRunner, build_app
from services.scheduler.lease import LeaseElector, LeaseSettings, ssl_context
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import ActivationQueue, MigrationSettings, PlacementLoop
from services.scheduler.responses import ArchiveUnavailable, ResponseStore, response_archive
from services.scheduler.routing import (
    Dispatcher,
    DispatchSettings,
    NodeWindows,
    WindowSettings,
    make_policy,
)
from services.scheduler.tenants import TenantLimits, Turns, key_book
from shared.config import ConfigError
from shared.grpc_server import serve_grpc
from shared.model_catalog import load_catalog, weight_bytes_of
from shared.proto import scheduler_pb2_grpc

log = logging.getLogger(__name__)


def build_state(
    config: SchedulerConfig,
    registry: NodeRegistry,
    channels: NodeChannels,
    sessions: SessionDirectory | None = None,
    prefixes: PrefixIndex | None = None,
) -> ApiState:
    metrics = SchedulerMetrics()
    if sessions is None:
        sessions = SessionDirectory(config.sessions_max, config.sessions_ttl_s)
    policy = make_policy(config.policy, config.move_tokens)
    catalog = load_catalog(config.models_config)
    inflight = InFlight(config.tpot_default_s)
    windows = NodeWindows(
        WindowSettings(config.admission_window, config.admission_wait_s,
                       config.admission_min_window, config.admission_min_scale,
                       config.admission_horizon_s),
        inflight, report=lambda node, size: metrics.admission_window.labels(node).set(size))
    # One queue of activations (Tangram §3.4) for the requests and the advisories of evicted
    # models: an advisory's activation takes its node out of the requests' pool too.
    activations = ActivationQueue()
    latencies = (ToolLatencies(config.tool_latency_default_s, config.tool_latency_quantile)
                 if config.infer_advisories else None)
    advisor = Advisor(
        AdvisoryBook(config.advisory_ttl_s, config.advisories_max,
                     per_tenant=config.advisories_per_tenant),
        AdvisoryThrottle(config.advisory_min_useful, config.advisory_throttle_rate, 5.0,
                         config.advisory_throttle_after),
        registry, policy, channels, sessions, metrics,
        catalog=frozenset(m.name for m in catalog), inflight=inflight, latencies=latencies,
        activations=activations, model_bytes=weight_bytes_of(catalog),
    )
    dispatcher = Dispatcher(
        registry,
        policy,
        channels,
        DispatchSettings(
            no_node_wait_s=config.no_node_wait_s,
            unavailable_retries=config.unavailable_retries,
            suspend_grace_s=config.heartbeat_interval_s,
            request_timeout_s=config.request_timeout_s,
            stream_idle_timeout_s=config.stream_idle_timeout_s,
            retry_after_s=config.retry_after_s,
            behind_hold_s=config.behind_hold_s,
        ),
        sessions,
        metrics,
        advisor,
        catalog=catalog,
        inflight=inflight,
        prefixes=prefixes,
        prefix_index=(PrefixIndex(config.prefix_index_blocks)
                      if config.policy == "prefix" else None),
        windows=windows,
        activations=activations,
    )
    # What a node held before it registered again is stale (see ``on_register``).
    registry.on_register(dispatcher.prefixes.forget_node)
    if dispatcher.prefix_index is not None:
        registry.on_register(dispatcher.prefix_index.forget_node)
    return ApiState(
        registry=registry,
        dispatcher=dispatcher,
        metrics=metrics,
        limits=Limits(config.max_n, config.max_prompts, config.default_max_tokens,
                      config.max_messages, config.max_tokens_limit,
                      strict_fields=config.strict_fields,
                      retention_s=(("in_memory", config.retention_in_memory_s),
                                   ("24h", config.retention_24h_s))),
        tenants=TenantLimits(config.tenant_requests_per_s, config.tenant_advisories_per_s,
                             config.tenant_max_in_flight, seats=registry.seats,
                             in_flight_per_seat=config.tenant_in_flight_per_seat),
        turns=Turns(config.retry_after_s),
        bodies=BodyBudget(config.tenant_body_bytes, config.max_body_bytes),
        body_timeout_s=config.body_timeout_s,
        keys=key_book(config),
        max_body_bytes=config.max_body_bytes,
        advisor=advisor,
        responses=ResponseStore(config.responses_ttl_s, config.responses_max,
                                archive=response_archive(config)),
        session_headers=tuple(config.session_headers),
    )


async def _watch_nodes(registry: NodeRegistry, period_s: float) -> None:
    """Log nodes entering and leaving rotation (health itself is computed on demand)."""
    while True:
        if log.isEnabledFor(logging.DEBUG):
            registry.check_integrity()
        left, joined = registry.sweep()
        for node_id in joined:
            log.info("node %s is in rotation", node_id)
        for node_id in left:
            node = registry.get(node_id)
            why = (
                node.load.problem if node and node.load.problem
                else "drained" if node and node.drained
                else "missed heartbeats or unreachable"
            )
            log.warning("node %s left rotation: %s", node_id, why)
        await asyncio.sleep(period_s)


async def _sweep_responses(store: ResponseStore, every_s: float) -> None:
    """Delete archived responses past their TTL: at start, then every ``every_s``
    (``scheduler.responses_sweep_s``); an archive that cannot be swept now is swept next
    time."""
    while True:
        try:
            gone = await asyncio.to_thread(store.archive.sweep, store.expired)
        except ArchiveUnavailable as e:
            log.warning("stored responses not swept: %s", e)
        else:
            if gone:
                log.info("deleted %d expired stored responses", gone)
        await asyncio.sleep(every_s)


async def _elect(config: SchedulerConfig, stack: AsyncExitStack,
                 on_change: Callable[[bool], None]) -> LeaseElector:
    """Run the Lease election until ``stack`` closes (releasing the Lease if held)."""
    if config.lease_renew_s * 3 > config.lease_duration_s:
        raise ConfigError(f"scheduler.lease_renew_s={config.lease_renew_s:g} must be at most "
                          f"a third of scheduler.lease_duration_s={config.lease_duration_s:g}; "
                          "lower the one or raise the other")
    namespace = config.lease_namespace or _pod_namespace(config.lease_token_file)
    identity = config.lease_identity or socket.gethostname()
    settings = LeaseSettings(config.lease_name, namespace, identity, config.lease_api_url,
                             config.lease_token_file, config.lease_ca_file,
                             config.lease_duration_s, config.lease_renew_s)
    connector = aiohttp.TCPConnector(ssl=ssl_context(config.lease_ca_file)
                                     if config.lease_api_url.startswith("https") else False)
    http = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
    elector = LeaseElector(settings, http, on_change=on_change)
    electing = asyncio.create_task(elector.run(), name="lease-election")

    async def stop_electing() -> None:
        electing.cancel()
        await asyncio.gather(electing, return_exceptions=True)

    stack.push_async_callback(stop_electing)
    log.info("electing the active scheduler through Lease %s/%s as %s", namespace,
             config.lease_name, identity)
    return elector


def _pod_namespace(token_file: str) -> str:
    """The pod's namespace, beside its service account token."""
    path = Path(token_file).with_name("namespace")
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"scheduler.lease_namespace is empty and {path} is unreadable "
                          f"({e.strerror}); set scheduler.lease_namespace") from None


@dataclass
class Running:
    """A started scheduler: where it listens and its live state (for tests and logs)."""

    http_port: int
    grpc_port: int
    state: ApiState


async def start(config: SchedulerConfig, stack: AsyncExitStack) -> Running:
    """Start both servers and the node watcher; ``stack`` stops them in reverse order."""
    registry = NodeRegistry(config.heartbeat_timeout_s)
    channels = NodeChannels()
    stack.push_async_callback(channels.close)
    sessions = SessionDirectory(config.sessions_max, config.sessions_ttl_s)
    # (each node holds at most sessions_max chats' leading contexts, as far as it knows)
    prefixes = PrefixIndex(config.sessions_max, config.sessions_max)
    leadership: list[LeaseElector] = []  # (filled below when the replicas elect a leader)
    servicer = SchedulerServicer(registry, config.heartbeat_interval_s, sessions,
                                 leader=lambda: not config.lease_name
                                 or any(e.is_leader for e in leadership),
                                 prefixes=prefixes)
    grpc_server = await stack.enter_async_context(
        serve_grpc(
            config.grpc_host,
            config.grpc_port,
            register=[lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s)],
            service_names=["overture.v1.Scheduler"],
        )
    )
    stack.push_async_callback(servicer.close)  # runs before the server stops
    state = build_state(config, registry, channels, sessions, prefixes)
    state.leader = servicer.leader
    if config.lease_name:
        leadership.append(await _elect(config, stack, servicer.leadership_changed))
    # Cancel a handler when its client disconnects, so the generation is cancelled too.
    runner = HardenedRunner(build_app(state), config.header_timeout_s,
                            config.keepalive_timeout_s, handler_cancellation=True,
                            access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    http_port = runner.addresses[0][1]
    watcher = asyncio.create_task(
        _watch_nodes(registry, min(0.5, config.heartbeat_timeout_s / 2)), name="node-watcher"
    )

    async def stop_watcher() -> None:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    stack.push_async_callback(stop_watcher)
    sweeper = asyncio.create_task(state.advisor.run_sweeper(), name="advisory-sweeper")

    async def stop_advisor() -> None:
        sweeper.cancel()
        await asyncio.gather(sweeper, return_exceptions=True)
        await state.advisor.close()

    stack.push_async_callback(stop_advisor)
    sweeping = asyncio.create_task(_sweep_responses(state.responses, config.responses_sweep_s),
                                   name="responses-sweeper")

    async def stop_sweeping() -> None:
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)

    stack.push_async_callback(stop_sweeping)
    catalog = tuple(state.dispatcher.catalog.values())
    if catalog and config.placement_interval_s > 0:
        placement = PlacementLoop(
            registry, channels, catalog, state.dispatcher.rates, config.placement_tau,
            MigrationSettings(config.migration_attempts, config.migration_backoff_s,
                              config.migration_backoff_s * 16), state.metrics)
        placing = asyncio.create_task(placement.run(config.placement_interval_s),
                                      name="model-placement")

        async def stop_placement() -> None:
            placing.cancel()
            await asyncio.gather(placing, return_exceptions=True)

        stack.push_async_callback(stop_placement)
    return Running(http_port, grpc_server.port, state)


async def run(config: SchedulerConfig) -> None:
    """Serve until cancelled."""
    async with AsyncExitStack() as stack:
        running = await start(config, stack)
        log.info(
            "scheduler ready on http://%s:%d (grpc %s:%d)",
            config.host,
            running.http_port,
            config.grpc_host,
            running.grpc_port,
        )
        await asyncio.Event().wait()
