"""``run(config)``: the node manager process."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from services.nodemgr.activation import Activator
from services.nodemgr.admission import DeadlineAdmission
from services.nodemgr.advisory_prefetcher import AdvisoryPrefetcher
from services.nodemgr.clock_offset import ClockOffset
from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.engine_set import EngineSet, UnknownModel
from services.nodemgr.grpc_service import NodeManagerServicer
from services.nodemgr.held_sessions import HeldSessions
from services.nodemgr.kvstore_probe import KVStoreProbe
from services.nodemgr.memory_broker import EngineMemory, MemoryBroker
from services.nodemgr.metrics import NodeMgrMetrics
from services.nodemgr.registration import Registrar
from services.nodemgr.residency import NodeResidency
from services.nodemgr.reuse_store import ReuseStore
from services.nodemgr.reuse_store.setup import model_gauges, open_store, store_gauges
from services.nodemgr.weight_cache import WeightCache
from services.nodemgr.weight_lending import Lender, catalog_rank, weights_lent
from shared.device_ledger import DeviceLedger
from shared.grpc_server import serve_grpc
from shared.metrics_http import serve_metrics
from shared.model_catalog import DEFAULT_TTFT_SLO_S, ModelEntry, load_catalog
from shared.model_residency import ResidencySource
from shared.proto import engine_pb2, engine_pb2_grpc, nodemgr_pb2_grpc

log = logging.getLogger(__name__)


async def start(config: NodeManagerConfig, stack: AsyncExitStack) -> asyncio.Task[None]:
    """Serve NodeManager, wait for the engine, then start registering and beating.

    Returns the registrar's task (owned by ``stack``). Raises ``EngineUnavailable`` when the
    engine is not ready within ``engine_wait_s``.
    """
    engine = EngineSet(config.engine_addresses or [config.engine_address],
                       config.engine_status_timeout_s, _ledger_budget(config.device_ledger))
    stack.push_async_callback(engine.close)
    registrar: Registrar | None = None
    kvstore = KVStoreProbe(config.kvstore_address, config.kvstore_probe_timeout_s)
    stack.push_async_callback(kvstore.close)

    def engine_failed(detail: str) -> None:
        if registrar is not None:
            registrar.engine_failed(detail)

    metrics = NodeMgrMetrics()
    remaps: dict[str, engine_pb2.RemapCounters] = {}  # per model, as the broker last polled
    prefetcher = AdvisoryPrefetcher(config.kvstore_address, config.prefetch_timeout_s,
                                    engines=lambda model: _stub_for(engine, model),
                                    metrics=metrics, fingerprint=engine.fingerprint,
                                    weights_lent=lambda: weights_lent(remaps.values()))
    stack.push_async_callback(prefetcher.close)
    catalog = load_catalog(config.models_config)
    weights = WeightCache()
    stack.callback(weights.close)
    weights.hold(catalog)
    store: ReuseStore | None = None
    if config.reuse_store_bytes and catalog:
        store = await open_store(config, catalog, stack)
    # What the node's heartbeats say of each model's weights (Tangram §3.4): the Reuse
    # Store's own account when the node has one, else the engines' and the page cache's.
    fallback = NodeResidency(catalog, weights, engine.served)
    residency: ResidencySource = store if store is not None else fallback
    activator = Activator(engine, catalog, evict_idle_s=config.evict_idle_s,
                          wait_s=config.activation_wait_s,
                          on_change=lambda: registrar.models_changed() if registrar else None,
                          metrics=metrics, on_loaded=fallback.loaded, store=store)
    admission = DeadlineAdmission(
        config.admission_depth, config.prefill_tokens_per_s,
        slo=lambda model: activator.catalog[model].ttft_slo_s
        if model in activator.catalog else DEFAULT_TTFT_SLO_S,
        max_waiting=config.admission_max_waiting, max_delay_s=config.admission_max_delay_s)
    clock = ClockOffset()  # the scheduler's, from the heartbeats
    servicer = NodeManagerServicer(config.node_id, engine, config.kvstore_address, engine_failed,
                                   prefetcher, activator, admission, clock)
    server = await stack.enter_async_context(
        serve_grpc(
            config.host,
            config.port,
            register=[lambda s: nodemgr_pb2_grpc.add_NodeManagerServicer_to_server(servicer, s)],
            service_names=["overture.v1.NodeManager"],
        )
    )
    address = config.advertise_address or f"{config.host}:{server.port}"
    log.info("waiting for the engine at %s", engine.address)
    snap = await engine.wait_ready(config.engine_wait_s, standby=bool(catalog))
    registrar = Registrar(
        node_id=config.node_id,
        address=address,
        kvstore_address=config.kvstore_address,
        scheduler_address=config.scheduler_address,
        engine=engine,
        models=snap.models,
        interval_s=config.heartbeat_interval_s,
        backoff_max_s=config.register_backoff_max_s,
        in_flight=lambda: servicer.in_flight,
        kvstore=kvstore,
        engine_stall_s=config.engine_stall_s,
        held=HeldSessions(config.held_sessions_max),
        metrics=metrics_targets(config),
        residency=residency,
        clock=clock,
    )
    beats = asyncio.create_task(registrar.run(), name="registrar")
    broker: MemoryBroker | None = None
    if config.device_ledger:
        broker = MemoryBroker(lambda: _engine_memory(engine, activator.catalog, remaps),
                              lambda name, pages: _shrink(engine, name, pages),
                              config.broker_interval_s,
                              busy=lambda: servicer.in_flight > 0 or prefetcher.active > 0,
                              idle_interval_s=config.broker_idle_interval_s,
                              release_weights=None if store is None else
                              lambda: store.release(config.reuse_release_bytes),
                              lend=(lambda name, n: _lend(engine, name, n))
                              if config.lend_weights else None,
                              revert_after_s=config.lend_revert_after_s)
        balancing = asyncio.create_task(broker.run(), name="memory-broker")

        async def stop_broker() -> None:
            balancing.cancel()
            await asyncio.gather(balancing, return_exceptions=True)

        stack.push_async_callback(stop_broker)
    if config.metrics_port:
        metrics.watch(lambda: {**_state(registrar, servicer), **_budget(config.device_ledger),
                               **_lending(broker),
                               **(store_gauges(store) if store is not None else {})})
        metrics.watch_models(lambda: _models_state(engine, activator, admission,
                                                   config.device_ledger, remaps))
        if store is not None:
            metrics.watch_models(lambda: model_gauges(store))

        async def render() -> bytes:
            return metrics.render()

        mport = await stack.enter_async_context(
            serve_metrics(render, config.host, config.metrics_port))
        log.info("metrics on http://%s:%d/metrics", config.host, mport)

    async def stop_beats() -> None:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)

    stack.push_async_callback(stop_beats)
    log.info(
        "nodemgr %s ready on %s (engine %s, models %s)",
        config.node_id,
        address,
        engine.address,
        ", ".join(m.name for m in snap.models),
    )
    return beats


async def run(config: NodeManagerConfig) -> None:
    """Serve until cancelled (or until the registrar fails)."""
    async with AsyncExitStack() as stack:
        beats = await start(config, stack)
        await beats


def _budget(path: str) -> dict[str, float]:
    """The node's device budget and what is free of it (with a shared ledger)."""
    if not path:
        return {}
    ledger = DeviceLedger(path)
    try:
        return {"device_budget_bytes": float(ledger.budget_bytes),
                "device_free_bytes": float(ledger.free_bytes()),
                "device_lent_bytes": float(ledger.lent_bytes())}  # (MIRAGE §5.2)
    finally:
        ledger.close()


def _lending(broker: MemoryBroker | None) -> dict[str, float]:
    """The node's lending of weights to KV (MIRAGE §5.2), counted since start."""
    if broker is None:
        return {}
    return {"weight_layers_lent": float(broker.layers_lent),
            "weight_layers_taken_back": float(broker.layers_taken_back)}


def _remap_gauges(r: engine_pb2.RemapCounters | None) -> dict[str, float]:
    """A model's remapping as its engine last reported it (MIRAGE's metrics, per model)."""
    if r is None:
        return {}
    return {"remap_alpha": float(r.alpha), "remap_node_layers": float(r.node_layers),
            "remap_lent_bytes": float(r.lent_bytes + r.node_lent_bytes),
            "remap_node_lent_bytes": float(r.node_lent_bytes),
            "remap_step_transfer_seconds": r.step_transfer_s,
            "remap_transfer_seconds": r.transfer_s,
            "remap_stalled_forwards": float(r.stalled_forwards)}


def _models_state(engine: EngineSet, activator: Activator, admission: DeadlineAdmission,
                  ledger_path: str, remaps: dict[str, engine_pb2.RemapCounters] | None = None
                  ) -> list[tuple[str, dict[str, float]]]:
    """Per model: active here, device bytes it holds (KV, weights) and reserves for its KV,
    requests queued, and its remapping (layers and bytes lent to KV, transfer times)."""
    active = {m.name for m in (engine.last.models if engine.last else ())}
    held: dict[str, tuple[int, int, int]] = {}
    if ledger_path:
        ledger = DeviceLedger(ledger_path)
        try:
            for h in ledger.holders():
                kv, w, r = held.get(h.label, (0, 0, 0))
                held[h.label] = (kv + h.kv_bytes, w + h.weight_bytes, r + h.reserve_bytes)
        finally:
            ledger.close()
    out = []
    for name in sorted(active | set(activator.catalog)):
        kv, w, r = held.get(name, (0, 0, 0))
        out.append((name, {"active": float(name in active), "kv_bytes": float(kv),
                           "weight_bytes": float(w), "kv_reserve_bytes": float(r),
                           "queued": float(admission.queued(name)),
                           **_remap_gauges((remaps or {}).get(name))}))
    return out


def _ledger_budget(path: str) -> int:
    if not path:
        return 0
    ledger = DeviceLedger(path)
    try:
        return ledger.budget_bytes
    finally:
        ledger.close()


async def _engine_memory(engines: EngineSet, catalog: dict[str, ModelEntry],
                         remaps: dict[str, engine_pb2.RemapCounters]) -> list[EngineMemory]:
    out = []
    remaps.clear()
    for link in engines.links:
        st = await link.raw_status()
        lending = None
        if st.HasField("remap") and st.models:  # (a float model with remapping on)
            r = remaps[st.models[0].name] = st.remap
            priority, pinned, slo = catalog_rank(st.models[0].name, catalog)
            lending = Lender(link.address, st.running, st.waiting, r.lendable_layers,
                             r.node_layers, priority, pinned, slo)
        out.append(EngineMemory(link.address, st.running, st.waiting, st.blocks_committed,
                                lending, st.remap.give_way if lending else ""))
    return out


async def _shrink(engines: EngineSet, address: str, pages: int, lend: int = 0) -> int:
    link = next(link for link in engines.links if link.address == address)
    reply = await link.stub.ShrinkKV(engine_pb2.ShrinkKVRequest(max_pages=pages,
                                                                lend_layers=lend),
                                     timeout=link.status_timeout_s)
    return int(reply.node_layers if lend else reply.pages)


async def _lend(engines: EngineSet, address: str, layers: int) -> int:
    """MIRAGE §5.2 across the node: the engine lends (< 0: takes back) layers' weight
    memory to the node's budget; the layers it has lent now."""
    return await _shrink(engines, address, 0, layers)


def _stub_for(engines: EngineSet, model: str) -> engine_pb2_grpc.EngineStub | None:
    try:
        return engines.for_model(model).stub
    except UnknownModel:
        return None


def _state(registrar: Registrar, servicer: NodeManagerServicer) -> dict[str, float]:
    return {"generations_in_flight": float(servicer.in_flight),
            "problem": 1.0 if registrar.problem else 0.0,
            "degraded": 1.0 if registrar.degraded else 0.0}


def metrics_targets(config: NodeManagerConfig) -> dict[str, str]:
    """The node's /metrics endpoints by service: ``metrics_targets`` and the nodemgr's own
    (when its port is fixed; a port picked at start-up is not known before the server)."""
    out: dict[str, str] = {}
    for item in config.metrics_targets:
        name, sep, addr = item.partition("=")
        if not sep or not name or ":" not in addr:
            raise ValueError(f"nodemgr.metrics_targets: {item!r} is not service=host:port "
                             "(e.g. kvstore=127.0.0.1:9101)")
        out[name] = addr
    if config.metrics_port:
        out["nodemgr"] = f"{config.host}:{config.metrics_port}"
    return out
