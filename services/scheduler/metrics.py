"""Prometheus metrics of one scheduler app, in their own registry (tests build many apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.scheduler.cluster import Load, NodeRegistry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "overture_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "overture_time_to_first_token_seconds",
            "time from request arrival to the first generated token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token_stage = Histogram(
            "overture_first_token_stage_seconds",
            "where the time to first token went: 'scheduler' (arrival to the node call, "
            "with the tries of nodes that refused it), 'to_engine' (on to the engine: the "
            "node manager, the connections), 'engine' (the engine's receipt to its first "
            "token: queue, tokenizing, loading, prefill), 'back' (the token's way back)",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "overture_inter_token_latency_seconds",
            "time between consecutive generated tokens of one choice",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "overture_generated_tokens", "tokens generated, by model", ["model"], registry=r
        )
        # By route only: the names come from clients, a label per name would be theirs to
        # multiply (the response header names them).
        self.ignored_fields = Counter(
            "overture_ignored_fields", "request fields ignored (nobody documents them)",
            ["route"], registry=r,
        )
        self.in_flight = Gauge(
            "overture_requests_in_flight", "generation requests being served", registry=r
        )
        self.affinity_choices = Counter(
            "overture_affinity_activations",
            "models activated where Tangram Algorithm 2 put them (least expected load "
            "time), by what asked (request, advisory, placement) and how much of the model "
            "the node already held (all, part, none, unknown)", ["origin", "reuse"], registry=r)
        self.migrations = Counter(
            "overture_model_migrations",
            "placement moves (Prism Algorithm 1) by outcome: done (active on the target, "
            "evicted from the source), abandoned (the source stayed busy; the target's copy "
            "evicted again), target_refused (the target could not activate it), failed (a "
            "node did not answer)", ["outcome"], registry=r)
        self.migration_retries = Counter(
            "overture_model_migration_retries",
            "evictions a busy source refused during a migration, each retried later",
            registry=r)
        self.node_load = Gauge(
            "overture_node_load",
            "load a node reports (running, waiting) or is routed (routed)",
            ["node", "kind"],
            registry=r,
        )
        self.node_up = Gauge(
            "overture_node_in_rotation", "1 if the node receives requests", ["node"], registry=r
        )
        self.node_degraded = Gauge(
            "overture_node_degraded",
            "1 if the node serves with a part down (e.g. its kvstore: it recomputes)",
            ["node"], registry=r,
        )
        self.node_queue_delay = Gauge(
            "overture_node_queue_delay_seconds",
            "how long the node's oldest queued request has waited", ["node"], registry=r,
        )
        # The engines' device prefetch of advised sessions (cumulative since each started).
        self.prefetch_bytes = Gauge(
            "overture_node_prefetch_bytes",
            "bytes an advisory copied into the node's device memory (kind=loaded), and of "
            "those the bytes of advisories never followed (kind=wasted)", ["node", "kind"],
            registry=r,
        )
        self.prefetch_purged = Gauge(
            "overture_node_prefetch_purged_blocks",
            "prefetched device blocks the engine purged for running requests, by layer",
            ["node", "layer"], registry=r,
        )
        self.prefetch_sessions = Gauge(
            "overture_node_prefetched_sessions",
            "advised sessions holding device blocks on the node now", ["node"], registry=r,
        )
        self.overloaded = Counter(
            "overture_overloaded",
            "requests refused with 429 because every node serving their model was behind",
            registry=r,
        )
        self.admission_refusals = Counter(
            "overture_admission_refusals",
            "429s of the scheduler's node choice, by reason: window_full (every node "
            "serving the model had its admission window full, scheduler.admission_window), "
            "node_behind (every one had refused a request as overloaded, or was held)",
            ["reason"], registry=r)
        self.admission_window = Gauge(
            "overture_admission_window",
            "generations the scheduler lets be in flight on a node (its admission window, "
            "sized from its measured completions; scheduler.admission_window)",
            ["node"], registry=r)
        self.stalled = Counter(
            "overture_streams_stalled",
            "generations cut because their node sent nothing within the inactivity bound",
            ["node"], registry=r,
        )
        self.retried = Counter(
            "overture_requests_retried_after_node_failure",
            "requests whose node's engine failed before their first token, sent to another "
            "node", registry=r,
        )
        self.advisories = Counter(
            "overture_advisories",
            "advisories by event: received, followed (its request came), expired (spurious), "
            "invalidated, replaced (a newer one for the session), throttled (refused: 429); "
            "source: client (POST /v1/advisory) or inferred (from a turn calling tools)",
            ["event", "source"], registry=r,
        )
        self.advisory_lead_time = Histogram(
            "overture_advisory_lead_time_seconds",
            "time from an advisory to the request that followed it",
            buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60), registry=r,
        )
        self.healthy_nodes = Gauge("overture_healthy_nodes", "nodes in rotation", registry=r)
        self.slo_attained = Counter(
            "overture_slo_requests", "requests of catalogue models by whether they met the "
            "model's SLO (slo: ttft, tpot; met: yes, no)", ["model", "slo", "met"], registry=r)
        self.turns = Counter(
            "overture_turns",
            "generations by where their prompt's KV was: device (the serving node's device "
            "cache), local (its kvstore tiers), peer (another node's kvstore), s3, recompute",
            ["kv_from"],
            registry=r,
        )
        self.sessions = Gauge(
            "overture_sessions_located", "sessions whose KV location the scheduler knows",
            registry=r,
        )

    def _prefetch(self, node: str, load: Load) -> None:
        self.prefetch_bytes.labels(node, "loaded").set(load.prefetch_loaded_bytes)
        self.prefetch_bytes.labels(node, "wasted").set(load.prefetch_wasted_bytes)
        self.prefetch_sessions.labels(node).set(load.prefetch_sessions)
        for layer, n in enumerate(load.prefetch_purged_by_layer):
            self.prefetch_purged.labels(node, str(layer)).set(n)

    def render(self, nodes: NodeRegistry) -> bytes:
        """Refresh the per-node gauges from the registry, then expose everything."""
        self.node_load.clear()
        self.node_up.clear()
        self.node_degraded.clear()
        self.node_queue_delay.clear()
        self.prefetch_bytes.clear()
        self.prefetch_purged.clear()
        self.prefetch_sessions.clear()
        for n in nodes.all():
            self._prefetch(n.node_id, n.load)
            self.node_load.labels(n.node_id, "running").set(n.load.running)
            self.node_load.labels(n.node_id, "waiting").set(n.load.waiting)
            self.node_load.labels(n.node_id, "routed").set(n.routed)
            self.node_up.labels(n.node_id).set(1 if nodes.in_rotation(n) else 0)
            self.node_degraded.labels(n.node_id).set(1 if n.load.degraded else 0)
            self.node_queue_delay.labels(n.node_id).set(n.load.queue_delay_s)
        self.healthy_nodes.set(len(nodes.healthy()))
        return generate_latest(self.registry)
