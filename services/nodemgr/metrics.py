"""The node manager's Prometheus metrics (``nodemgr.metrics_port``): advisories it was
given and how their two prefetch hops went (kvstore DRAM, then device), generations in
flight through it, and whether it is registered, degraded or has a problem; with several
models: per model its state, activations and their duration, device bytes held (KV and
weights) and queued requests; per node its device budget and what is free of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class NodeMgrMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.advisories = Counter("overture_nodemgr_advisories", "advisories by event "
                                  "(received, invalidated, expired, followed)", ["event"],
                                  registry=self.registry)
        self.prefetch_hops = Counter("overture_nodemgr_prefetch_hops", "prefetch hops by "
                                     "result (hop: dram, device)", ["hop", "result"],
                                     registry=self.registry)
        self.prefetch_bytes = Counter("overture_nodemgr_prefetch_dram_bytes",
                                      "bytes the kvstore brought into DRAM for advisories",
                                      registry=self.registry)
        self.dram_seconds = Histogram("overture_nodemgr_prefetch_dram_seconds",
                                      "time of the DRAM hop", registry=self.registry,
                                      buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30))

        self.activations = Counter("overture_model_activations", "models activated into "
                                   "an engine of this node", ["model"], registry=self.registry)
        self.activation_seconds = Histogram(
            "overture_model_activation_seconds", "time to activate a model (load and "
            "set-up)", ["model"], registry=self.registry,
            buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
        self.evictions = Counter("overture_model_evictions", "models evicted from this "
                                 "node's engines", ["model"], registry=self.registry)

    def watch_models(self, state: Callable[[], list[tuple[str, dict[str, float]]]]) -> None:
        """Per-model gauges read at each scrape: (model, {name: value})."""
        self.registry.register(_ModelGauges(state))

    def watch(self, state: Callable[[], dict[str, float]]) -> None:
        """Gauges read at each scrape (``state()``: name -> value)."""
        self.registry.register(_Gauges(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges(Collector):
    def __init__(self, state: Callable[[], dict[str, float]]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        for name, value in self.state().items():
            yield GaugeMetricFamily(f"overture_nodemgr_{name}", name.replace("_", " "),
                                    value=value)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _ModelGauges(Collector):
    def __init__(self, state: Callable[[], list[tuple[str, dict[str, float]]]]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for model, values in self.state():
            for name, value in values.items():
                fam = families.get(name)
                if fam is None:
                    fam = families[name] = GaugeMetricFamily(
                        f"overture_model_{name}", name.replace("_", " "), labels=["model"])
                fam.add_metric([model], value)
        yield from families.values()

    def describe(self) -> Iterator[Metric]:
        return iter(())
