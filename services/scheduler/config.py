"""Scheduler configuration (section ``scheduler:``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = opt("127.0.0.1", "address the public HTTP API binds to")
    port: int = opt(8000, "public HTTP port (OpenAI API, demo page, metrics)", min=0, max=65535)
    grpc_host: str = opt("127.0.0.1", "address the Scheduler gRPC server binds to")
    grpc_port: int = opt(50051, "Scheduler gRPC port for node registration", min=0, max=65535)
    heartbeat_interval_s: float = opt(1.0, "interval nodes are told to beat at", min=0.05, max=60)
    heartbeat_timeout_s: float = opt(3.0, "a node silent this long leaves rotation", min=0.1)
    no_node_wait_s: float = opt(
        2.0, "how long a request waits for a healthy node before 503", min=0
    )
    max_body_bytes: int = opt(4 << 20, "largest accepted request body", min=1024)
    body_timeout_s: float = opt(
        30.0, "a request body not fully received this long after its headers is refused "
        "(408)", min=0.1)
    header_timeout_s: float = opt(
        10.0, "a connection that has not sent its first request's headers this long after "
        "connecting is closed", min=0.1)
    keepalive_timeout_s: float = opt(
        30.0, "an idle keep-alive connection is closed after this long", min=0.1)
    max_messages: int = opt(2048, "most messages in one chat request", min=1)
    max_tokens_limit: int = opt(
        2**31 - 1, "the largest max_tokens a request may ask for", min=1, max=2**31 - 1)
    tenant_requests_per_s: float = opt(
        200.0, "generations per second one tenant may start (burst: 2 s worth; 0 = no "
        "limit); beyond: 429 with Retry-After", min=0.0)
    tenant_advisories_per_s: float = opt(
        100.0, "advisories per second one tenant may send (burst: 2 s worth; 0 = no limit)",
        min=0.0)
    tenant_max_in_flight: int = opt(
        512, "generations one tenant may have running at once (0 = no limit)", min=0)
    request_timeout_s: float = opt(600.0, "upper bound on one request's duration", min=1)
    api_keys: dict[str, str] = opt(
        {}, "bearer key (or sha256:<hex> of it) -> tenant; environment: key=tenant,... "
        "(none and not anonymous: the scheduler does not start)")
    admin_keys: list[str] = opt(
        [], "bearer keys (or sha256:<hex>) for /admin routes and /metrics")
    keys_file: str = opt(
        "", "YAML file with more keys: {api_keys: {key: tenant}, admin_keys: [key]}")
    anonymous: bool = opt(
        False, "serve without API keys (every caller is tenant 'default', admin routes "
        "open); only on a loopback host; overture up's default")
    sessions_max: int = opt(
        100_000, "sessions whose KV location is remembered (least recently used go first)",
        min=1,
    )
    sessions_ttl_s: float = opt(
        24 * 3600.0, "a session's KV location is forgotten this long after its last turn",
        min=1.0,
    )
    policy: str = opt(
        "balanced", "placement policy: balanced (load first; KV follows the session; "
        "advisories prefetch), priority (balanced; high-priority sessions spread evenly and "
        "prefetched straight into device memory), sticky (a session stays on its first "
        "node; baseline), recompute (no KV reuse at all; baseline), prefix (the node whose "
        "device holds the longest prompt prefix; KV only in device memory; baseline)",
        choices=("balanced", "priority", "sticky", "recompute", "prefix"),
    )
    prefix_index_blocks: int = opt(
        8192, "policy prefix: prompt blocks (64 characters, about 16 tokens) each node's "
        "device is assumed to hold; the least recently served go first (set it to the "
        "engines' device KV capacity)", min=1)
    advisory_ttl_s: float = opt(
        30.0, "an advisory not followed by its request this long after its expected arrival "
        "is dropped as spurious", min=0.1, max=3600.0,
    )
    advisories_max: int = opt(100_000, "pending advisories kept (oldest dropped)", min=1)
    advisories_per_tenant: int = opt(
        10_000, "pending advisories one tenant may have (more: 429)", min=1,
    )
    advisory_min_useful: float = opt(
        0.2, "a tenant whose advisories are followed less often than this (share, over "
        "about advisory_throttle_after recent ones) is throttled", min=0.0, max=1.0,
    )
    advisory_throttle_after: int = opt(
        20, "advisories a tenant must have had end before it can be throttled", min=1,
    )
    advisory_throttle_rate: float = opt(
        1.0, "advisories per second a throttled tenant may still send (burst: 5)", min=0.01,
    )
    models_config: str = opt(
        "", "YAML file whose models: list is the cluster's model catalogue (models the "
        "nodes activate on demand; overture up writes one for several --model)")
    placement_interval_s: float = opt(
        10.0, "how often models are placed onto nodes by KV pressure (Prism Algorithm 1; "
        "with a model catalogue and two nodes or more); 0 = never", min=0)
    placement_tau: float = opt(
        0.5, "Algorithm 1's migration threshold τ: a model moves only when the KV pressure "
        "(SLO-weighted requests/s per GiB of free device memory) drops by more", min=0)
    responses_ttl_s: float = opt(
        3600.0, "stored Responses API responses (previous_response_id) live this long",
        min=1)
    responses_max: int = opt(10_000, "stored responses per tenant (least recently used "
                             "dropped)", min=1)
    max_n: int = opt(8, "largest `n`; each choice is a separate generation", min=1, max=64)
    max_prompts: int = opt(8, "most prompts in one /v1/completions request", min=1, max=64)
    default_max_tokens: int = opt(
        0, "max_tokens when a request gives none; 0 = up to the context", min=0
    )
    stream_idle_timeout_s: float = opt(
        10.0, "a generation whose node sends nothing this long (engines send keepalives "
        "every engine.stream_keepalive_s while busy, not while a step is stuck) is cut with "
        "an error and the node taken out of rotation until it beats again; before any "
        "output it is retried on another node", min=0.5,
    )
    retry_after_s: int = opt(
        1, "Retry-After (seconds) of a 429 sent when every node serving the model is "
        "behind", min=1, max=3600,
    )
    behind_hold_s: float = opt(
        0.25, "a node that refused a request as overloaded gets no new ones for this long "
        "(or until it reports an empty queue)", min=0.0, max=60.0,
    )
    unavailable_retries: int = opt(
        2, "re-routes of a request whose node is unreachable before any output", min=0, max=16
    )
