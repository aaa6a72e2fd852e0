"""The engine's Prometheus metrics (``engine.metrics_port``), read from the same status
snapshot the Status RPC answers with, at each scrape: device blocks by state, sequences
running and waiting, prompt tokens by where their KV came from, kvstore calls, and the
advisory prefetch's counters. Nothing is counted twice or kept apart from the engine's
own numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.engine.api_types import EngineStatus


class _Snapshot(Collector):
    def __init__(self, status: EngineStatus, model: str) -> None:
        self.status, self.model = status, model

    def collect(self) -> Iterator[Metric]:
        s, r = self.status, self.status.reuse
        labels = ["model"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        blocks = GaugeMetricFamily("overture_engine_kv_blocks", "device KV blocks by state",
                                   labels=[*labels, "state"])
        for state, n in (("free", s.blocks_free), ("used", s.blocks_used),
                         ("evictable", s.blocks_evictable), ("committed", s.blocks_committed)):
            blocks.add_metric([self.model, state], n)
        yield blocks
        yield gauge("overture_engine_kv_blocks_total", "device KV blocks in the budget",
                    s.blocks_total)
        yield gauge("overture_engine_device_budget_bytes", "the device KV budget",
                    s.device_budget_bytes)
        seqs = GaugeMetricFamily("overture_engine_sequences", "sequences by state",
                                 labels=[*labels, "state"])
        seqs.add_metric([self.model, "running"], s.running)
        seqs.add_metric([self.model, "waiting"], s.waiting)
        yield seqs
        yield counter("overture_engine_admitted", "sequences admitted to a seat", s.admitted)
        yield counter("overture_engine_preemptions", "sequences preempted", s.preemptions)
        tokens = CounterMetricFamily("overture_engine_prompt_tokens",
                                     "prompt tokens by where their KV came from",
                                     labels=[*labels, "kv_from"])
        tokens.add_metric([self.model, "device"], r.device_tokens)
        for tier, n in sorted(r.loaded_tokens.items()):
            tokens.add_metric([self.model, tier], n)
        tokens.add_metric([self.model, "recompute"], r.recomputed_tokens)
        yield tokens
        calls = CounterMetricFamily("overture_engine_kvstore_calls", "calls to the kvstore",
                                    labels=[*labels, "call", "result"])
        for call, ok, failed in (("lookup", r.lookups - r.lookup_errors, r.lookup_errors),
                                 ("save", r.saves - r.save_errors, r.save_errors)):
            calls.add_metric([self.model, call, "ok"], max(0, ok))
            calls.add_metric([self.model, call, "error"], failed)
        yield calls
        yield counter("overture_engine_kv_load_failures", "loads that failed (recomputed)",
                      r.load_failures)
        yield counter("overture_engine_chunks_saved", "KV chunks saved", r.chunks_saved)
        yield gauge("overture_engine_kvstore_attached", "1 while the pool is attached",
                    1.0 if r.attached else 0.0)
        p = r.prefetch
        if p is not None:
            yield gauge("overture_engine_prefetch_sessions", "advised sessions held",
                        p.sessions)
            yield gauge("overture_engine_prefetch_blocks_resident",
                        "their blocks on the device", p.blocks_resident)
            moved = CounterMetricFamily("overture_engine_prefetch_bytes",
                                        "bytes prefetched into the device",
                                        labels=[*labels, "kind"])
            moved.add_metric([self.model, "loaded"], p.loaded_bytes)
            moved.add_metric([self.model, "wasted"], p.wasted_bytes)
            yield moved
            outcomes = CounterMetricFamily("overture_engine_prefetch_outcomes",
                                           "how advised sessions ended",
                                           labels=[*labels, "outcome"])
            for outcome, n in sorted(p.outcomes.items()):
                outcomes.add_metric([self.model, outcome], n)
            yield outcomes
        m = s.remap
        if m is not None:  # MIRAGE: weight memory lent to the KV cache
            yield gauge("overture_engine_remap_alpha", "layers whose weight memory is lent "
                        "to the KV cache now", m.alpha)
            yield gauge("overture_engine_remap_layers_streamed", "layers streamed through "
                        "slots each step (alpha + slots)", len(m.layers))
            yield gauge("overture_engine_remap_lent_bytes", "weight bytes lent as KV",
                        m.lent_bytes)
            yield gauge("overture_engine_remap_node_layers", "of them, layers lent to the "
                        "node's budget (other engines' KV; MIRAGE §5.2)", m.node_layers)
            yield gauge("overture_engine_remap_node_lent_bytes", "weight bytes lent to the "
                        "node's budget", m.node_lent_bytes)
            yield counter("overture_engine_remap_layers_lent", "layers lent, ever", m.remaps)
            yield counter("overture_engine_remap_layers_reverted", "layers given back, ever",
                          m.reversions)
            yield counter("overture_engine_remap_transfer_seconds", "time copying streamed "
                          "layers into their slots", m.transfer_s)
            yield gauge("overture_engine_remap_step_transfer_seconds", "the last step's "
                        "layer copies", m.step_transfer_s)
            yield counter("overture_engine_remap_stalled_steps", "forwards a layer copy made "
                          "wait", m.stalled_forwards)


def render_engine_metrics(status: EngineStatus) -> bytes:
    """The Prometheus text of one status snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    model = status.models[0].name if status.models else ""
    registry.register(_Snapshot(status, model))
    return generate_latest(registry)
