"""Prometheus metrics of one kvstore, in its own CollectorRegistry (no global state).

Exposed by ``shared/metrics_http.serve_metrics`` on ``kvstore.metrics_port`` (0 = off) and
summarised in the gRPC ``Status`` reply.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class LoopCounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounter:
    """A labelled counter bumped only from the event loop's thread, without a lock.

    ``prometheus_client.Counter.inc`` takes a mutex (~0.6 us here), as much as the rest of
    a DRAM hit's or put's bookkeeping; the per-chunk counters of the store's tier calls
    (hits, misses, bytes in/out: ``store_io.TierIO``, which runs on the loop) use this
    instead and are exported at scrape time like any counter (``<name>_total``).
    """

    def __init__(
        self, name: str, documentation: str, labelnames: list[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._children: dict[tuple[str, ...], LoopCounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopCounterChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = LoopCounterChild()
        return child

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class KVStoreMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.hits = LoopCounter("kvstore_hits", "chunk reads found in a tier", ["tier"], r)
        self.misses = LoopCounter(
            "kvstore_misses", "chunk reads not found in a tier", ["tier"], r
        )
        self.bytes_in = LoopCounter("kvstore_bytes_in", "bytes written into a tier", ["tier"], r)
        self.bytes_out = LoopCounter("kvstore_bytes_out", "bytes read from a tier", ["tier"], r)
        self.latency = Histogram(
            "kvstore_op_seconds",
            "latency of one tier operation",
            ["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "kvstore_evictions", "entries evicted for capacity", ["tier"], registry=r
        )
        self.expired = Counter(
            "kvstore_expired", "entries removed by TTL sweeps", ["tier"], registry=r
        )
        self.sessions_expired = Counter(
            "kvstore_sessions_expired",
            "sessions removed when their prompt_cache_retention ran out", registry=r
        )
        self.checksum_failures = Counter(
            "kvstore_checksum_failures",
            "corrupt chunks found (deleted, served as a miss)",
            ["tier"],
            registry=r,
        )
        self.tier_errors = Counter(
            "kvstore_tier_errors", "tier calls that failed", ["tier", "op"], registry=r
        )
        self.queue_depth = Gauge(
            "kvstore_write_behind_depth", "queued write-behind jobs", registry=r
        )
        self.dropped_writes = Counter(
            "kvstore_write_behind_dropped",
            "write-behind jobs dropped because the queue was full",
            registry=r,
        )
        self.durable_writes = Counter(
            "kvstore_durable_writes", "chunks acknowledged durable", registry=r
        )

        # Same-node data path to the engine's pool (pool_path.py).
        self.pool_bytes_saved = Counter(
            "kvstore_pool_bytes_saved", "KV bytes copied from engine pools into DRAM", registry=r
        )
        self.pool_bytes_loaded = Counter(
            "kvstore_pool_bytes_loaded", "KV bytes copied from the tiers into engine pools",
            ["tier"], registry=r,
        )
        self.lookup_blocks = Counter(
            "kvstore_lookup_blocks",
            "prompt blocks looked up: result=hit (stored, leased) or miss",
            ["result"], registry=r,
        )
        self.load_seconds = Histogram(
            "kvstore_pool_load_seconds", "one LoadIntoPool call, first read to last layer",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.load_failures = Counter(
            "kvstore_pool_load_failures", "LoadIntoPool calls that stopped at a bad layer",
            registry=r,
        )
        self.active_leases = Gauge("kvstore_leases", "prefix leases held", registry=r)

        # Across nodes (peers/): what this node pulled from the kvstore of the node that
        # served a session's previous turn, and what it served to others.
        self.peer_bytes = Counter(
            "kvstore_peer_bytes_pulled", "chunk bytes pulled from a peer kvstore", ["peer"],
            registry=r,
        )
        self.prefetches = Counter(
            "kvstore_prefetches",
            "advisory prefetches into DRAM: result=found (the session's KV was somewhere), "
            "none", ["result"], registry=r,
        )
        self.prefetched_bytes = Counter(
            "kvstore_prefetched_bytes", "chunk bytes brought into DRAM by advisory prefetches",
            registry=r,
        )
        self.peer_lookups = Counter(
            "kvstore_peer_lookups",
            "FindPrefix calls to a peer: result=hit (it held more of the prompt), miss, error",
            ["result"], registry=r,
        )
        self.peer_pull_seconds = Histogram(
            "kvstore_peer_pull_seconds", "one pull from a peer, request to last chunk",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.peer_served = Counter(
            "kvstore_peer_lookups_served", "FindPrefix calls answered for peers: result=hit|miss",
            ["result"], registry=r,
        )
        self.peer_wait_seconds = Histogram(
            "kvstore_peer_save_wait_seconds",
            "FindPrefix: time a peer's question waited for this node's save in flight",
            buckets=_LATENCY_BUCKETS, registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (tests and Status read counters through this)."""
        v = self.registry.get_sample_value(name, labels or None)
        return float(v or 0.0)
