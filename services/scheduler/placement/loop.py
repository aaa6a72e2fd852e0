"""The scheduler's periodic model placement (Prism §6.2): from the request rate each model
has had, its TTFT SLO and weight size, and each node's device memory, Algorithm 1
(``algorithm.place_models``) says where each model should run. A model running
elsewhere than placed, by more than the migration threshold τ of KV pressure, is moved
(``migration.py``: the target activates it, the old node evicts it once idle, retried
while busy, abandoned explicitly after a bounded number of tries). Between nodes of equal
KV pressure, the one that would load it soonest is chosen (Tangram §3.4, Eq. 3). Models
that run nowhere are left to on-demand activation.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from services.scheduler.cluster import Node, NodeChannels, NodeRegistry
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement.affinity import estimate, fallback_bandwidth, model_bytes
from services.scheduler.placement.algorithm import ModelDemand, place_models
from services.scheduler.placement.migration import (
    DONE,
    Migration,
    MigrationSettings,
    Migrator,
)
from services.scheduler.placement.rates import ModelRates
from shared.model_catalog import ModelEntry

log = logging.getLogger(__name__)

KEPT_MIGRATIONS = 100  # the most recent moves kept for inspection (``migrations``)


class PlacementLoop:
    def __init__(self, registry: NodeRegistry, channels: NodeChannels,
                 catalog: tuple[ModelEntry, ...], rates: ModelRates, tau: float,
                 migration: MigrationSettings | None = None,
                 metrics: SchedulerMetrics | None = None, migrator: Migrator | None = None
                 ) -> None:
        self.registry = registry
        self.channels = channels
        self.catalog = {m.name: m for m in catalog}
        self.rates = rates
        self.tau = tau
        self.metrics = metrics
        self.migrator = migrator or Migrator(registry, channels,
                                             migration or MigrationSettings(), metrics)
        self._weights = {m.name: _weights(m) for m in catalog}
        self.moves = 0
        self.migrations: deque[Migration] = deque(maxlen=KEPT_MIGRATIONS)

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
        placed = place_models(demands, capacity, self.tau / 2**30,
                              load_s=self._load_time([n for n in nodes
                                                      if n.node_id in capacity]))
        return {d.name: (d.current, placed[d.name]) for d in demands
                if d.current is not None and placed[d.name] != d.current}

    def _load_time(self, nodes: list[Node]) -> Callable[[str, str], float]:
        """Tangram Eq. 3 for (model, node), from the nodes' residency reports."""
        by_id = {n.node_id: n for n in nodes}
        fallback = fallback_bandwidth(nodes)

        def load_s(model: str, node_id: str) -> float:
            size = model_bytes(model, nodes, self._weights.get(model, 0))
            return estimate(model, by_id[node_id], size, fallback).load_s
        return load_s

    async def step(self) -> int:
        """Plan, then carry each move out to its end (done, abandoned, refused, failed)."""
        moved = 0
        for model, (old, new) in self.plan().items():
            target = self.registry.get(new)
            if target is not None and self.metrics is not None:
                nodes = self.registry.healthy()
                est = estimate(model, target, model_bytes(model, nodes,
                                                          self._weights.get(model, 0)),
                               fallback_bandwidth(nodes))
                self.metrics.affinity_choices.labels("placement", est.reuse).inc()
            m = await self.migrator.run(Migration(model, old, new))
            self.migrations.append(m)
            moved += m.outcome == DONE
        self.moves += moved
        return moved

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
