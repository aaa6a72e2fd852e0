"""The scheduler's periodic model placement (Prism §6.2): from the request rate each model
has had, its TTFT SLO and weight size, and each node's device memory, Algorithm 1
(``algorithm.place_models``) says where each model should run. A model running
elsewhere than placed, by more than the migration threshold τ of KV pressure, is moved:
the target node activates it, then the old node evicts it once idle (until then both
serve it). Models that run nowhere are left to on-demand activation.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.scheduler.cluster import NodeChannels, NodeRegistry
from services.scheduler.placement.algorithm import ModelDemand, place_models
from services.scheduler.placement.rates import ModelRates
from shared.model_catalog import ModelEntry
from shared.proto import nodemgr_pb2

log = logging.getLogger(__name__)

MOVE_CALL_S = 120.0


class PlacementLoop:
    def __init__(self, registry: NodeRegistry, channels: NodeChannels,
                 catalog: tuple[ModelEntry, ...], rates: ModelRates, tau: float) -> None:
        self.registry = registry
        self.channels = channels
        self.catalog = {m.name: m for m in catalog}
        self.rates = rates
        self.tau = tau
        self._weights = {m.name: _weights(m) for m in catalog}
        self.moves = 0

    def plan(self) -> dict[str, tuple[str, str]]:
        """Model -> (from node, to node) for each model Algorithm 1 moves."""
        nodes = self.registry.healthy()
        capacity = {n.node_id: n.load.device_budget_bytes for n in nodes
                    if n.load.device_budget_bytes > 0}
        if len(capacity) < 2:
            return {}
        demands = []
        for name, entry in self.catalog.items():
            running = [n.node_id for n in nodes if n.serves(name) and n.node_id in capacity]
            if len(running) != 1:
                # Evicted: activated on demand where the pressure is lowest. On several
                # nodes: replicas the operator started (Algorithm 1 places one copy).
                continue
            demands.append(ModelDemand(name, self.rates.rate(name), self._weights[name],
                                       entry.ttft_slo_s, current=running[0]))
        # τ is given per GiB of device memory (KVPR is per byte here).
        placed = place_models(demands, capacity, self.tau / 2**30)
        return {d.name: (d.current, placed[d.name]) for d in demands
                if d.current is not None and placed[d.name] != d.current}

    async def step(self) -> int:
        moved = 0
        for model, (old, new) in self.plan().items():
            if await self._move(model, old, new):
                moved += 1
        self.moves += moved
        return moved

    async def _move(self, model: str, old: str, new: str) -> bool:
        target, source = self.registry.get(new), self.registry.get(old)
        if target is None or source is None:
            return False
        log.info("placement: moving %s from %s to %s (Algorithm 1)", model, old, new)
        try:
            reply = await self.channels.stub(target.info.address).ActivateModel(
                nodemgr_pb2.ModelRequest(model=model), timeout=MOVE_CALL_S)
            if not reply.done:
                log.info("placement: %s could not activate %s: %s", new, model, reply.detail)
                return False
            await self.channels.stub(source.info.address).EvictModel(
                nodemgr_pb2.ModelRequest(model=model), timeout=MOVE_CALL_S)
        except grpc.aio.AioRpcError as e:
            log.warning("placement: moving %s to %s failed: %s %s", model, new,
                        e.code().name, e.details())
            return False
        return True

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.step()
            except Exception:
                log.exception("model placement round failed")


def _weights(entry: ModelEntry) -> int:
    try:
        return entry.weight_bytes()
    except OSError:  # (the folder is on the nodes, not here)
        return 0
