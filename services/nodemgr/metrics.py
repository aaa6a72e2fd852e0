"""The node manager's Prometheus metrics (``nodemgr.metrics_port``): advisories it was
given and how their two prefetch hops went (kvstore DRAM, then device), generations in
flight through it, and whether it is registered, degraded or has a problem."""

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
