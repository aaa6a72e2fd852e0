"""Bring a catalogue model into one of the node's engines when a request for it arrives
(Prism §5.2 fast activation, §6.2 eviction and activation).

    request for model m, no engine serves it
      -> a standby engine of the node (model-less, waiting for an activation), if any
      -> else evict a model idle for evict_idle_s (not pinned; the one with the loosest TTFT
         SLO first, then the longest idle) and reuse its engine
      -> Activate(m) on that engine (weights from the page cache: the weight cache keeps
         the catalogue's files there); when the node's budget cannot hold m's weights,
         evict another idle model and try again
    The request waits through all this (its TTFT counts it) and fails only when nothing
    can be evicted within wait_s.

One activation per model at a time: requests arriving meanwhile wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.nodemgr.engine_link import EngineLink
from services.nodemgr.engine_set import EngineSet, UnknownModel
from services.nodemgr.metrics import NodeMgrMetrics
from services.nodemgr.reuse_store import NoRoom, ReuseStore, index_model
from shared.model_catalog import ModelEntry
from shared.proto import engine_pb2

log = logging.getLogger(__name__)

ACTIVATE_TIMEOUT_S = 120.0
RETRY_S = 0.1


class CannotActivate(RuntimeError):
    """No engine could be freed for the model in time (``busy``: retry later), or the
    model does not load (not ``busy``: its catalogue entry or files are wrong)."""

    def __init__(self, message: str, busy: bool = True) -> None:
        super().__init__(message)
        self.busy = busy


@dataclass
class EngineView:
    link: EngineLink
    model: str  # "" = none (a standby engine)
    running: int
    waiting: int


def victim(engines: list[EngineView], catalog: dict[str, ModelEntry], idle_since: dict[str, float],
           now: float, idle_s: float, spare: EngineLink | None = None,
           in_use: frozenset[str] = frozenset()) -> EngineView | None:
    """The engine whose model to evict: idle (nothing running or queued) for ``idle_s``,
    not pinned, not ``spare``, with no request on its way to it (``in_use``: taken by the
    node, not yet counted by the engine); the loosest TTFT SLO first, then the longest
    idle."""
    def ok(e: EngineView) -> bool:
        entry = catalog.get(e.model)
        return (bool(e.model) and e.link is not spare and not e.running and not e.waiting
                and e.model not in in_use and not (entry is not None and entry.pin)
                and now - idle_since.get(e.model, 0.0) >= idle_s)

    slo = {name: m.ttft_slo_s for name, m in catalog.items()}
    candidates = [e for e in engines if ok(e)]
    if not candidates:
        return None
    return max(candidates, key=lambda e: (slo.get(e.model, 0.0),
                                          now - idle_since.get(e.model, 0.0)))


class Activator:
    def __init__(self, engines: EngineSet, catalog: tuple[ModelEntry, ...], *,
                 evict_idle_s: float, wait_s: float,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 metrics: NodeMgrMetrics | None = None,
                 on_loaded: Callable[[str, float], None] = lambda model, seconds: None,
                 store: ReuseStore | None = None) -> None:
        self.engines = engines
        self.on_loaded = on_loaded  # (model, seconds): the node's load bandwidth measure
        self.store = store  # the node's Reuse Store: weights activate through it
        self.catalog = {m.name: m for m in catalog}
        self.evict_idle_s = evict_idle_s
        self.wait_s = wait_s
        self.on_change = on_change
        self._clock = clock
        self.metrics = metrics or NodeMgrMetrics()
        self._locks: dict[str, asyncio.Lock] = {}
        self.last_used: dict[str, float] = {}  # model -> when a request last came for it
        self.activations: list[tuple[str, float]] = []  # (model, seconds), for metrics
        self.evictions = 0
        # Engines an activation under way has chosen: no other activation may pick them
        # (one would evict or overwrite the model the other is loading).
        self._claimed: set[str] = set()
        self._requests: dict[str, int] = {}  # model -> requests in the node (enter/leave)
        # advisory id -> (model, until when): an advised model's request is on its way, so
        # it is not evicted before it comes (released when it comes, or the advisory ends)
        self._advised: dict[str, tuple[str, float]] = {}

    def used(self, model: str) -> None:
        self.last_used[model] = self._clock()

    def enter(self, model: str) -> None:
        """A request for ``model`` is in the node (until ``leave``): its model is not idle,
        even before its engine counts the request."""
        self.used(model)
        self._requests[model] = self._requests.get(model, 0) + 1

    def leave(self, model: str) -> None:
        self.used(model)
        left = self._requests.get(model, 0) - 1
        if left > 0:
            self._requests[model] = left
        else:
            self._requests.pop(model, None)

    def hold(self, advisory_id: str, model: str, ttl_s: float) -> None:
        """An advisory for ``model`` is pending: keep it from eviction for up to ``ttl_s``
        (the advisory's own life: an end the scheduler fails to tell does not pin it)."""
        self._advised[advisory_id] = (model, self._clock() + ttl_s)

    def release(self, advisory_id: str) -> bool:
        """The advisory was followed, invalidated or expired: its model may go again."""
        return self._advised.pop(advisory_id, None) is not None

    def holding(self) -> frozenset[str]:
        """The advisories whose models are held now."""
        self.advised()
        return frozenset(self._advised)

    def advised(self) -> frozenset[str]:
        now = self._clock()
        for aid, (_, until) in list(self._advised.items()):
            if until <= now:
                del self._advised[aid]
        return frozenset(model for model, _ in self._advised.values())

    def _in_use(self) -> frozenset[str]:
        return frozenset(self._requests) | self.advised()

    async def engine_for(self, model: str) -> EngineLink:
        """The engine serving ``model``, activating it first if need be. Raises
        UnknownModel (not in the catalogue) or CannotActivate."""
        try:
            return self.engines.for_model(model)
        except UnknownModel:
            if model not in self.catalog:
                raise
        async with self._locks.setdefault(model, asyncio.Lock()):
            try:  # (activated by the request before this one)
                return self.engines.for_model(model)
            except UnknownModel:
                pass
            return await self._activate(self.catalog[model])

    async def _activate(self, entry: ModelEntry) -> EngineLink:
        if not (Path(entry.path) / "config.json").is_file():  # (before evicting anything)
            log.error("catalogue model %s: %s is not a model folder", entry.name, entry.path)
            raise CannotActivate(f"model {entry.name} cannot be activated: its folder is "
                                 "missing on this node", busy=False)
        deadline = self._clock() + self.wait_s
        target: EngineLink | None = None
        try:
            while True:
                views = await self._views()
                if target is None:
                    empty = [v.link for v in views
                             if not v.model and v.link.address not in self._claimed]
                    if empty:
                        target = empty[0]
                        self._claimed.add(target.address)
                    else:
                        target = await self._evict_one(views, None, keep_claim=True)
                if target is not None:
                    link = await self._load(entry, target, deadline)
                    if link is not None:
                        return link
                    continue
                if self._clock() > deadline:
                    raise CannotActivate(f"every engine of this node is busy; none could be "
                                         f"freed for {entry.name} within {self.wait_s:g}s")
                await asyncio.sleep(RETRY_S)
        finally:
            if target is not None:
                self._claimed.discard(target.address)

    async def _load(self, entry: ModelEntry, target: EngineLink, deadline: float
                    ) -> EngineLink | None:
        """Activate ``entry`` on ``target``; None: its weights did not fit and another
        model was evicted to make room (or none could be yet): try again."""
        started = self._clock()
        request = engine_pb2.ActivateRequest(model_path=entry.path,
                                             served_model_name=entry.name)
        if self.store is not None:
            try:
                await self._plan(entry, request)
            except NoRoom as e:
                log.info("no room for %s's weights (%s): evicting an idle model", entry.name, e)
                if await self._evict_one(await self._views(), target) is None \
                        and self._clock() > deadline:
                    raise CannotActivate(f"the node's weight memory cannot hold "
                                         f"{entry.name}: {e}") from None
                await asyncio.sleep(RETRY_S)
                return None
        try:
            reply = await target.stub.Activate(request, timeout=ACTIVATE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if self.store is not None:
                self.store.aborted(entry.name)
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.error("activating %s from %s failed: %s", entry.name, entry.path,
                          e.details())
                raise CannotActivate(f"model {entry.name} cannot be activated: "
                                     f"{e.details()}", busy=False) from None
            # The node's budget cannot hold its weights: free another model's.
            if await self._evict_one(await self._views(), target) is None \
                    and self._clock() > deadline:
                raise CannotActivate(
                    f"the node's device memory cannot hold {entry.name} and no "
                    f"model has been idle {self.evict_idle_s:g}s to evict") from None
            await asyncio.sleep(RETRY_S)
            return None
        except BaseException:
            if self.store is not None:
                self.store.aborted(entry.name)
            raise
        if self.store is not None:
            self.store.committed(entry.name, reply.fill_seconds)
        seconds = self._clock() - started
        self.activations.append((entry.name, seconds))
        self.on_loaded(entry.name, seconds)
        self.metrics.activations.labels(entry.name).inc()
        self.metrics.activation_seconds.labels(entry.name).observe(seconds)
        self.used(entry.name)
        log.info("activated %s in %.2fs on the engine at %s", entry.name, seconds,
                 target.address)
        await self.engines.status()  # (learns what each engine serves now)
        self.on_change()
        return target

    async def _plan(self, entry: ModelEntry, request: engine_pb2.ActivateRequest) -> None:
        """Ask the Reuse Store where ``entry``'s tensors are (indexing it first, off the
        loop, if it never was) and put that in ``request``; NoRoom: evict first."""
        store = self.store
        assert store is not None
        if entry.name not in store.indexes:
            store.add_index(await asyncio.to_thread(index_model, entry.name, entry.path,
                                                    store.dtype))
        plan = store.plan(entry.name)
        request.weights_arena = store.arena.path
        request.weights_arena_bytes = store.arena.nbytes
        request.weights_dtype = store.dtype
        request.stored.extend(engine_pb2.StoredTensor(name=m.name, offset=m.offset,
                                                      nbytes=m.nbytes, fill=m.fill)
                              for m in plan)

    def _evicted(self, model: str) -> None:
        """``model``'s engine no longer serves it: its weights stay resident, unpinned."""
        if self.store is not None and model in self.store.indexes:
            self.store.deactivated(model)

    async def evict(self, model: str) -> bool:
        """Evict ``model`` from this node if it is idle now (the placement moved it)."""
        async with self._locks.setdefault(model, asyncio.Lock()):
            for v in await self._views():
                if (v.model == model and not v.running and not v.waiting
                        and model not in self._in_use()):
                    await v.link.stub.Evict(engine_pb2.EvictRequest(),
                                            timeout=ACTIVATE_TIMEOUT_S)
                    self._evicted(model)
                    self.evictions += 1
                    self.metrics.evictions.labels(model).inc()
                    log.info("evicted %s (placed elsewhere) from the engine at %s", model,
                             v.link.address)
                    await self.engines.status()
                    self.on_change()
                    return True
        return False

    async def _evict_one(self, views: list[EngineView], spare: EngineLink | None,
                         keep_claim: bool = False) -> EngineLink | None:
        """Evict the best victim (``victim``) among the engines no activation has
        claimed; its engine, or None. The engine is claimed from the moment it is chosen
        (so that no other activation takes it once empty) and stays claimed with
        ``keep_claim``, for the caller to load its model into and release."""
        free = [v for v in views if v.link.address not in self._claimed]
        v = victim(free, self.catalog, self.last_used, self._clock(), self.evict_idle_s,
                   spare, self._in_use())
        if v is None:
            return None
        self._claimed.add(v.link.address)
        try:
            await v.link.stub.Evict(engine_pb2.EvictRequest(), timeout=ACTIVATE_TIMEOUT_S)
            self._evicted(v.model)
            self.evictions += 1
            self.metrics.evictions.labels(v.model).inc()
            log.info("evicted %s (idle) from the engine at %s", v.model, v.link.address)
            await self.engines.status()
            self.on_change()
        except BaseException:
            self._claimed.discard(v.link.address)
            raise
        if not keep_claim:
            self._claimed.discard(v.link.address)
        return v.link

    async def _views(self) -> list[EngineView]:
        out = []
        for link in self.engines.links:
            st = await link.raw_status()
            model = st.models[0].name if st.models else ""
            out.append(EngineView(link, model, st.running, st.waiting))
            if model and model not in self.last_used:
                self.last_used[model] = 0.0  # (serving since start, never asked: idle)
        return out
