"""One placement move carried out whole: a model leaves one node for another (Prism §6.2,
made whole as Tangram's issue asks: no move silently dropped).

    1. the target activates the model (ActivateModel); refused: outcome target_refused,
       nothing changed (Algorithm 1 proposes it again next round if it still says so)
    2. the source is marked as leaving the model (``Node.leaving``): once the scheduler
       knows the target serves it, new requests for it go there and the source drains
    3. the source is asked to evict it (EvictModel) only once the target serves it in the
       scheduler's view (it re-registered with it): the model is active on the target
       before the source gives it up, and no request finds it nowhere
    4. a busy source refuses (its requests are still running): asked again after a backoff
       that doubles (``MigrationSettings``), ``attempts`` times in all; still busy, the move
       is abandoned: logged, counted, the source keeps the model and the target's copy is
       evicted again so the model runs on one node and the next round places it afresh
       (a model on two nodes is a replica Algorithm 1 leaves alone)
    A node that does not answer ends the move as failed, with the same undoing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from services.scheduler.cluster import NodeChannels, NodeRegistry
from services.scheduler.metrics import SchedulerMetrics
from shared.proto import nodemgr_pb2

log = logging.getLogger(__name__)

MOVE_CALL_S = 120.0
GONE_WAIT_S = 10.0  # the longest the source's new registration is waited for
GONE_POLL_S = 0.1

DONE = "done"
ABANDONED = "abandoned"
TARGET_REFUSED = "target_refused"
FAILED = "failed"


@dataclass(frozen=True)
class MigrationSettings:
    attempts: int = 8  # evictions asked of the source before the move is abandoned
    backoff_s: float = 0.5  # the first wait between them; doubles
    backoff_max_s: float = 8.0


@dataclass
class Migration:
    """A move under way or ended, as ``PlacementLoop.migrations`` shows it."""

    model: str
    source: str
    target: str
    outcome: str = ""  # "" while under way
    refusals: int = 0  # evictions the busy source refused


class Migrator:
    def __init__(self, registry: NodeRegistry, channels: NodeChannels,
                 settings: MigrationSettings, metrics: SchedulerMetrics | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.registry = registry
        self.channels = channels
        self.settings = settings
        self.metrics = metrics
        self._sleep = sleep

    async def run(self, m: Migration) -> Migration:
        """Carry ``m`` out; its ``outcome`` says how it ended (never raises an RPC error)."""
        try:
            m.outcome = await self._run(m)
        except grpc.aio.AioRpcError as e:
            log.warning("placement: moving %s from %s to %s failed: %s %s", m.model,
                        m.source, m.target, e.code().name, e.details())
            m.outcome = FAILED
            await self._undo(m)
        finally:
            self.registry.set_leaving(m.source, m.model, False)
        if self.metrics is not None:
            self.metrics.migrations.labels(m.outcome).inc()
        return m

    async def _run(self, m: Migration) -> str:
        target, source = self.registry.get(m.target), self.registry.get(m.source)
        if target is None or source is None:
            return FAILED
        log.info("placement: moving %s from %s to %s (Algorithm 1)", m.model, m.source,
                 m.target)
        reply = await self.channels.stub(target.info.address).ActivateModel(
            nodemgr_pb2.ModelRequest(model=m.model), timeout=MOVE_CALL_S)
        if not reply.done:
            log.info("placement: %s could not activate %s: %s", m.target, m.model,
                     reply.detail)
            return TARGET_REFUSED
        self.registry.set_leaving(m.source, m.model, True)
        backoff = self.settings.backoff_s
        for attempt in range(self.settings.attempts):
            if attempt:
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.settings.backoff_max_s)
            if not self._serves(m.target, m.model):
                continue  # (the target's new registration has not reached us yet)
            source = self.registry.get(m.source)
            if source is None or not source.serves(m.model):
                return DONE  # (it evicted the model by itself meanwhile)
            reply = await self.channels.stub(source.info.address).EvictModel(
                nodemgr_pb2.ModelRequest(model=m.model), timeout=MOVE_CALL_S)
            if reply.done:
                log.info("placement: moved %s from %s to %s", m.model, m.source, m.target)
                await self._until_gone(m)
                return DONE
            m.refusals += 1
            if self.metrics is not None:
                self.metrics.migration_retries.inc()
            log.info("placement: %s refused to evict %s (%s); asking again in %.1fs",
                     m.source, m.model, reply.detail, backoff)
        log.warning("placement: abandoning the move of %s from %s to %s: the source "
                    "refused to evict it %d times (busy)", m.model, m.source, m.target,
                    m.refusals)
        await self._undo(m)
        return ABANDONED

    async def _until_gone(self, m: Migration) -> None:
        """Keep the source marked leaving until its registration without the model is in
        (bounded): a request sent there meanwhile would activate the model again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GONE_WAIT_S
        while self._serves(m.source, m.model) and loop.time() < deadline:
            await self.registry.wait_changed(GONE_POLL_S)

    def _serves(self, node_id: str, model: str) -> bool:
        node = self.registry.get(node_id)
        return node is not None and node.serves(model)

    async def _undo(self, m: Migration) -> None:
        """The source keeps the model: evict the target's copy (if idle) so that the model
        runs on one node again and the next round can place it."""
        self.registry.set_leaving(m.source, m.model, False)
        target = self.registry.get(m.target)
        if target is None:
            return
        try:
            reply = await self.channels.stub(target.info.address).EvictModel(
                nodemgr_pb2.ModelRequest(model=m.model), timeout=MOVE_CALL_S)
        except grpc.aio.AioRpcError as e:
            log.warning("placement: %s keeps a copy of %s: %s", m.target, m.model,
                        e.details())
            return
        if not reply.done:
            log.info("placement: %s keeps its copy of %s too (busy): it runs on both",
                     m.target, m.model)
