"""The node's half of an advisory (Symphony §3.3, §3.4): decide what to move for it and
move the advised session's KV into place, in two hops.

``Advise`` answers at once; ``AdvisoryPrefetcher`` prefetches in the background:

    1. the node's kvstore stages the session's newest KV in its DRAM, lowest layer first,
       from the kvstore that holds it (the scheduler names it) or else from its own tiers
       and the shared S3 tier (``KVStore.PrefetchSession``, the kvstore's ``staging.py``);
    2. the engine copies it from there into device blocks it is not using, lower layers
       of every advised session before higher layers of any (``Engine.Prefetch``, the
       engine's device prefetch); the engine purges those blocks itself when running
       requests need them.

A few prefetches run at a time. ``Invalidate`` stops one still running and tells the
engine: an invalidated advisory's device blocks are freed at once, an expired one's become
the first to purge. What reached DRAM stays: it is a cache, evicted like any other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.nodemgr.channels import fast_channel
from services.nodemgr.metrics import NodeMgrMetrics
from shared.proto import engine_pb2, engine_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # (the engine stores a request without a tenant under this one)
ENGINE_CALL_S = 5.0  # deadline of a Prefetch / EndPrefetch call to the engine
MAX_REMEMBERED = 10_000  # advisories remembered for their end


@dataclass(frozen=True)
class Advice:
    """An advisory as this node received it (``AdviseRequest``)."""

    advisory_id: str
    tenant: str
    session_id: str
    kv_source: str  # kvstore holding the session's KV; empty: this node's tiers and S3
    priority: int = 0
    ttl_s: float = 0.0  # the advisory's time to live (0: the engine's default)
    straight_to_device: bool = False
    kv_tokens: int = 0  # the session's last turn's length: its save is waited for
    model: str = ""  # the model it will use: its engine takes the KV ("": the first)


class AdvisoryPrefetcher:
    """The advisories this node took, each prefetched in two hops (see the module doc),
    until it is followed by a request, invalidated or expires."""

    def __init__(self, kvstore_address: str, timeout_s: float, concurrency: int = 4,
                 engines: Callable[[str], engine_pb2_grpc.EngineStub | None] | None = None,
                 metrics: NodeMgrMetrics | None = None,
                 fingerprint: Callable[[str], str] = lambda model: "",
                 weights_lent: Callable[[], bool] = lambda: False) -> None:
        """``engines``: the engine stub of a model (None: that device hop is skipped);
        ``fingerprint``: a model's fingerprint (the kvstore keeps a manifest per model);
        ``weights_lent``: whether the node lends weight memory to KV now while prefetched
        KV gives way first (``shared/give_way.py``): then the device hop is held back
        (its blocks would be the first purged, and weights are already lent for KV)."""
        self.channel = fast_channel(kvstore_address) if kvstore_address else None
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel) if self.channel else None
        self._engines = engines or (lambda model: None)
        self._fingerprint = fingerprint
        self._weights_lent = weights_lent
        self.metrics = metrics or NodeMgrMetrics()
        self.timeout_s = timeout_s
        self._gate = asyncio.Semaphore(concurrency)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._advice: dict[str, Advice] = {}  # advisory id -> its advice, until it ends
        self._by_session: dict[SessionKey, str] = {}  # (tenant, session) -> advisory id
        self._tasks: set[asyncio.Task[None]] = set()

    def advise(self, advice: Advice) -> bool:
        """Start prefetching; False when this node has no kvstore to prefetch into."""
        if self.stub is None:
            return False
        self.metrics.advisories.labels("received").inc()
        old = self._running.pop(advice.advisory_id, None)
        if old is not None:
            old.cancel()
        self._advice[advice.advisory_id] = advice
        self._by_session[SessionKey(advice.tenant, advice.session_id)] = advice.advisory_id
        while len(self._advice) > MAX_REMEMBERED:  # (ended advisories the node never heard of)
            gone = self._advice.pop(next(iter(self._advice)))
            if self._by_session.get(SessionKey(gone.tenant, gone.session_id)) == gone.advisory_id:
                del self._by_session[SessionKey(gone.tenant, gone.session_id)]
        task = asyncio.create_task(self._stage_then_fill(advice),
                                   name=f"prefetch-{advice.session_id}")
        self._running[advice.advisory_id] = task
        task.add_done_callback(lambda t: self._done(advice.advisory_id, t))
        return True

    def invalidate(self, advisory_id: str, expired: bool = False) -> bool:
        """The advisory ended unfollowed: stop its prefetch if it still runs, and tell the
        engine (its device blocks are freed, or first to purge when ``expired``); whether
        a prefetch was still running."""
        advice = self._advice.pop(advisory_id, None)
        if advice is not None:
            self.metrics.advisories.labels("expired" if expired else "invalidated").inc()
        if advice is not None and self._by_session.get(
                SessionKey(advice.tenant, advice.session_id)) == advisory_id:
            del self._by_session[SessionKey(advice.tenant, advice.session_id)]
        if advice is not None and self._engines(advice.model) is not None:
            end = self._end_on_engine(advice, expired)
            t = asyncio.create_task(end, name=f"end-prefetch-{advice.session_id}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        task = self._running.pop(advisory_id, None)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    def followed(self, tenant: str, session_id: str) -> None:
        """A request of the session came: its advisory is over (the engine knows already)."""
        aid = self._by_session.pop(SessionKey(tenant, session_id), None)
        if aid is not None:
            self.metrics.advisories.labels("followed").inc()
        if aid is not None:
            self._advice.pop(aid, None)

    async def _end_on_engine(self, a: Advice, expired: bool) -> None:
        engine = self._engines(a.model)
        assert engine is not None
        try:
            await engine.EndPrefetch(engine_pb2.EndPrefetchRequest(
                tenant=a.tenant, session_id=a.session_id, expired=expired),
                timeout=ENGINE_CALL_S)
        except grpc.aio.AioRpcError as e:
            log.warning("ending the prefetch of advisory %s on the engine failed: %s %s",
                        a.advisory_id, e.code().name, e.details())

    @property
    def active(self) -> int:
        """Advisories whose prefetch is under way."""
        return len(self._running)

    def _done(self, advisory_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(advisory_id) is task:
            del self._running[advisory_id]

    async def _stage_then_fill(self, a: Advice) -> None:
        """Hop 1: the kvstore stages the session in its DRAM; then hop 2."""
        assert self.stub is not None
        request = kvstore_pb2.PrefetchSessionRequest(
            session=kvstore_pb2.ManifestRef(tenant=a.tenant or DEFAULT_TENANT,
                                            session_id=a.session_id,
                                            model_fp=self._fingerprint(a.model)),
            peer_address=a.kv_source,
            wait_tokens=a.kv_tokens,
        )
        async with self._gate:
            t0 = time.monotonic()
            try:
                reply = await self.stub.PrefetchSession(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                log.warning("prefetch for advisory %s (session %s) failed: %s %s",
                            a.advisory_id, a.session_id, e.code().name, e.details())
                self.metrics.prefetch_hops.labels("dram", "error").inc()
                return
            self.metrics.dram_seconds.observe(time.monotonic() - t0)
        self.metrics.prefetch_hops.labels("dram", "found" if reply.found else "none").inc()
        self.metrics.prefetch_bytes.inc(reply.bytes)
        if reply.found:
            log.info("advisory %s: session %s prefetched into DRAM (%d chunks, %d bytes%s)",
                     a.advisory_id, a.session_id, reply.chunks, reply.bytes,
                     f", {reply.missing} missing" if reply.missing else "")
        else:
            log.info("advisory %s: nothing new stored for session %s (%s)", a.advisory_id,
                     a.session_id, reply.detail)
        await self._fill_device(a)

    async def _fill_device(self, a: Advice) -> None:
        """Hop 2: the engine takes the session's KV from the kvstore into free device
        blocks (it may hold the session already even when hop 1 found nothing new)."""
        engine = self._engines(a.model)
        if engine is None:
            return
        if self._weights_lent():  # the give-way order: prefetched KV before weights
            self.metrics.prefetch_hops.labels("device", "held").inc()
            return
        try:
            reply = await engine.Prefetch(engine_pb2.PrefetchRequest(
                tenant=a.tenant, session_id=a.session_id, priority=a.priority,
                ttl_s=a.ttl_s, straight_to_device=a.straight_to_device),
                timeout=ENGINE_CALL_S)
        except grpc.aio.AioRpcError as e:
            log.warning("device prefetch for advisory %s failed: %s %s", a.advisory_id,
                        e.code().name, e.details())
            self.metrics.prefetch_hops.labels("device", "error").inc()
            return
        self.metrics.prefetch_hops.labels("device", "started" if reply.blocks else "none").inc()
        if reply.blocks:
            log.info("advisory %s: session %s going into device memory (%d blocks a layer)",
                     a.advisory_id, a.session_id, reply.blocks)

    async def close(self) -> None:
        tasks = [*self._running.values(), *self._tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.close()
