"""A placement move carried out whole (Prism §6.2): a busy source that refuses to evict is
asked again after a doubling backoff, and after ``attempts`` refusals the move is abandoned
explicitly (counted, the target's copy evicted again), never dropped; the source is asked
only once the target serves the model, and meanwhile new requests go to the target. The
nodes are gRPC NodeManager servers that answer as scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc

from services.scheduler.cluster import Load, ModelSpec, NodeChannels, NodeInfo, NodeRegistry
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import (
    Migration,
    MigrationSettings,
    Migrator,
    ModelRates,
    PlacementLoop,
)
from shared.grpc_server import serve_grpc
from shared.model_catalog import ModelEntry
from shared.proto import nodemgr_pb2, nodemgr_pb2_grpc

GIB = 2**30


class ScriptedNode(nodemgr_pb2_grpc.NodeManagerServicer):
    """Activates when ``activates``; refuses ``busy_for`` evictions, then evicts. An
    activation registers the node anew with the model, as a real node manager does."""

    def __init__(self, node_id: str, registry: NodeRegistry, models: tuple[str, ...],
                 activates: bool = True, busy_for: int = 0) -> None:
        self.node_id = node_id
        self.registry = registry
        self.models = list(models)
        self.activates = activates
        self.busy_for = busy_for
        self.address = ""
        self.calls: list[tuple[str, str]] = []
        self.routable_while_busy: list[list[str]] = []  # healthy(model) at each refusal

    def register(self) -> None:
        self.registry.register(NodeInfo(self.node_id, self.address,
                                        tuple(ModelSpec(m) for m in self.models)))
        self.registry.heartbeat(self.node_id, Load(device_budget_bytes=8 * GIB,
                                                   blocks_free=100))

    async def ActivateModel(self, request: nodemgr_pb2.ModelRequest,
                            context: grpc.aio.ServicerContext) -> nodemgr_pb2.ModelReply:
        self.calls.append(("activate", request.model))
        if not self.activates:
            return nodemgr_pb2.ModelReply(done=False, detail="every engine is busy")
        self.models.append(request.model)
        self.register()
        return nodemgr_pb2.ModelReply(done=True)

    async def EvictModel(self, request: nodemgr_pb2.ModelRequest,
                         context: grpc.aio.ServicerContext) -> nodemgr_pb2.ModelReply:
        self.calls.append(("evict", request.model))
        if self.busy_for > 0:
            self.busy_for -= 1
            self.routable_while_busy.append(
                [n.node_id for n in self.registry.healthy(request.model)])
            return nodemgr_pb2.ModelReply(done=False, detail="busy or not here")
        if request.model not in self.models:
            return nodemgr_pb2.ModelReply(done=False, detail="busy or not here")
        self.models.remove(request.model)
        self.register()
        return nodemgr_pb2.ModelReply(done=True)


@asynccontextmanager
async def nodes(*scripted: ScriptedNode) -> AsyncIterator[NodeChannels]:
    channels = NodeChannels()
    async with AsyncExitStack() as stack:
        for node in scripted:
            server = await stack.enter_async_context(serve_grpc(
                "127.0.0.1", 0, register=[
                    lambda s, n=node: nodemgr_pb2_grpc.add_NodeManagerServicer_to_server(n, s)],
                service_names=[], grace_s=0.1))
            node.address = f"127.0.0.1:{server.port}"
            node.register()
        try:
            yield channels
        finally:
            await channels.close()


class Sleeps:
    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


@dataclass
class Moved:
    """One migration of model "m" from "src" to "dst", run to its end."""

    migration: Migration
    reg: NodeRegistry
    src: ScriptedNode
    dst: ScriptedNode
    metrics: SchedulerMetrics
    sleeps: Sleeps


def migrate(settings: MigrationSettings | None = None, busy_for: int = 0,
            activates: bool = True, src_address: str = "") -> Moved:
    """The source holds "m" and refuses ``busy_for`` evictions; the target activates when
    ``activates``; ``src_address`` re-registers the source where nothing answers."""
    async def run() -> Moved:
        reg = NodeRegistry(heartbeat_timeout_s=60)
        src = ScriptedNode("src", reg, ("m",), busy_for=busy_for)
        dst = ScriptedNode("dst", reg, (), activates=activates)
        metrics, sleeps = SchedulerMetrics(), Sleeps()
        async with nodes(src, dst) as channels:
            if src_address:
                src.address = src_address
                src.register()
            mig = Migrator(reg, channels, settings or MigrationSettings(), metrics,
                           sleep=sleeps)
            m = await asyncio.wait_for(mig.run(Migration("m", "src", "dst")), 30)
        return Moved(m, reg, src, dst, metrics, sleeps)
    return asyncio.run(run())


def test_a_busy_source_is_asked_again_with_backoff_until_it_evicts() -> None:
    r = migrate(MigrationSettings(attempts=5, backoff_s=0.5, backoff_max_s=8.0), busy_for=2)
    assert (r.migration.outcome, r.migration.refusals) == ("done", 2)
    assert r.sleeps.waits == [0.5, 1.0]
    # Active on the target before the source was asked; requests went there meanwhile.
    assert r.dst.calls == [("activate", "m")] and r.src.calls == [("evict", "m")] * 3
    assert r.src.routable_while_busy == [["dst"], ["dst"]]
    assert [n.node_id for n in r.reg.healthy("m")] == ["dst"]
    assert not r.reg.get("src").leaving  # type: ignore[union-attr]
    assert r.metrics.migrations.labels("done")._value.get() == 1
    assert r.metrics.migration_retries._value.get() == 2


def test_a_source_busy_through_every_attempt_abandons_the_move_explicitly() -> None:
    r = migrate(MigrationSettings(attempts=4, backoff_s=1.0, backoff_max_s=2.0), busy_for=100)
    assert (r.migration.outcome, r.migration.refusals) == ("abandoned", 4)
    assert r.sleeps.waits == [1.0, 2.0, 2.0]  # (capped)
    # The target's copy is evicted again: the model runs on its source alone, and the
    # next round of Algorithm 1 sees it (it skips models on several nodes).
    assert r.dst.calls == [("activate", "m"), ("evict", "m")]
    assert [n.node_id for n in r.reg.healthy("m")] == ["src"]
    assert not r.reg.get("src").leaving  # type: ignore[union-attr]
    assert r.metrics.migrations.labels("abandoned")._value.get() == 1


def test_a_target_that_cannot_activate_leaves_the_source_untouched() -> None:
    r = migrate(activates=False)
    assert r.migration.outcome == "target_refused" and r.src.calls == []
    assert r.metrics.migrations.labels("target_refused")._value.get() == 1


def test_a_node_that_does_not_answer_fails_the_move_and_it_is_undone() -> None:
    r = migrate(src_address="127.0.0.1:1")  # (nothing listens there)
    assert r.migration.outcome == "failed"
    assert r.dst.calls == [("activate", "m"), ("evict", "m")]
    assert not r.reg.get("src").leaving  # type: ignore[union-attr]
    assert r.metrics.migrations.labels("failed")._value.get() == 1


def test_the_placement_round_records_every_move_and_its_outcome() -> None:
    """The loop's round: Algorithm 1 spreads two busy models; the busy source refuses
    once; the move ends done and is kept in ``migrations`` (before: the refusal was
    ignored and the move counted as made)."""
    async def run() -> None:
        reg = NodeRegistry(heartbeat_timeout_s=60)
        src = ScriptedNode("n0", reg, ("a", "b"), busy_for=1)
        dst = ScriptedNode("n1", reg, ())
        rates = ModelRates()
        for _ in range(50):
            rates.record("a")
            rates.record("b")
        catalog = (ModelEntry("a", "/nowhere/a"), ModelEntry("b", "/nowhere/b"))
        async with nodes(src, dst) as channels:
            loop = PlacementLoop(reg, channels, catalog, rates, tau=0.0,
                                 metrics=SchedulerMetrics(),
                                 migrator=Migrator(reg, channels, MigrationSettings(),
                                                   sleep=Sleeps()))
            assert await asyncio.wait_for(loop.step(), 10) == 1
        (m,) = loop.migrations
        assert (m.source, m.target, m.outcome, m.refusals) == ("n0", "n1", "done", 1)
        assert len(reg.healthy(m.model)) == 1 and reg.healthy(m.model)[0].node_id == "n1"
    asyncio.run(run())
