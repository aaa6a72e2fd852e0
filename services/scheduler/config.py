"""Scheduler configuration (section ``scheduler:``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt, sub
from shared.s3_config import S3Config


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
    tenant_body_bytes: int = opt(
        64 << 20, "bytes of request bodies one tenant may have being read at once (a body "
        "counts its Content-Length, or max_body_bytes without one); beyond: 429, and 413 "
        "for a body larger than this; 0 = no limit", min=0)
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
        0, "generations one tenant may have running at once; 0 = sized from the cluster's "
        "capacity (tenant_in_flight_per_seat)", min=0)
    tenant_in_flight_per_seat: float = opt(
        2.0, "with tenant_max_in_flight 0: generations one tenant may have in flight per "
        "seat (engine.max_num_seqs) of the nodes in rotation; 0 = no limit", min=0.0)
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
    move_tokens: int = opt(
        0, "policy balanced/priority: a session leaves the node holding its KV only when "
        "that node's expected load exceeds the least loaded's by more than its history's "
        "tokens / move_tokens requests (moving pulls the history across); 0 = load alone",
        min=0)
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
    migration_attempts: int = opt(
        8, "a placement move asks the source to evict the model this many times while it "
        "is busy before the move is abandoned (the target's copy is evicted again)",
        min=1, max=1000)
    migration_backoff_s: float = opt(
        0.5, "the wait before a placement move asks a busy source again; doubles each "
        "time, up to 16x", min=0.01, max=60)
    responses_ttl_s: float = opt(
        3600.0, "stored Responses API responses (previous_response_id) live this long",
        min=1)
    responses_max: int = opt(10_000, "stored responses per tenant (least recently used "
                             "dropped)", min=1)
    responses_sweep_s: float = opt(
        600.0, "how often stored responses past responses_ttl_s are deleted from their "
        "archive (the state folder, or the S3 bucket); the first sweep runs at start",
        min=1)
    responses_sweep_max: int = opt(
        1000, "stored responses one sweep of the S3 archive reads at most (it resumes "
        "where the last stopped: a sweep is bounded work however many the bucket holds)",
        min=1)
    strict_fields: bool = opt(
        False, "a request field no one documents (not OpenAI's, not a known extension) is "
        "a 400 naming it; off: ignored, named in X-Overture-Ignored-Fields and counted")
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
    # ---- admission at the scheduler (routing/window.py; docs/operations.md)
    admission_window: bool = opt(
        True, "give each node a window of generations in flight, sized from its measured "
        "completion rate by Little's law and narrowed when first tokens come late; a "
        "request finding every node's window full gets 429 with Retry-After at once; "
        "false: only the engines refuse (engine.max_queue_delay_s)")
    admission_wait_s: float = opt(
        0.5, "the wait from a request's arrival to its first token the windows keep "
        "admitted requests within (keep it at engine.max_queue_delay_s)", min=0.01, max=60.0)
    admission_min_window: int = opt(
        16, "the smallest window of a node, whatever its measured capacity (a window is "
        "never below the node's seats either)", min=1, max=1 << 20)
    admission_min_scale: float = opt(
        0.25, "the least that late first tokens may narrow a window's queue allowance "
        "(capacity x admission_wait_s) to, as a share of it (1 = no narrowing)", min=0.01,
        max=1.0)
    admission_horizon_s: float = opt(
        2.0, "a node's completion rate and service time are measured over its completions "
        "of this last stretch; its capacity (the highest rate) is forgotten over ten",
        min=0.1, max=600.0)
    unavailable_retries: int = opt(
        2, "re-routes of a request whose node is unreachable before any output", min=0, max=16
    )
    # ---- surviving a restart (stored responses; see docs/operations.md)
    state_dir: str = opt(
        "", "folder the scheduler keeps its state in (stored responses, owner-only) when "
        "s3.bucket is empty; empty: stored responses live in memory only")
    s3: S3Config = sub(S3Config, "the cluster's shared S3 bucket (the same keys as "
                       "kvstore.s3): stored responses go there, under the tenant")
    lease_name: str = opt(
        "", "Kubernetes Lease (coordination.k8s.io/v1) the replicas elect their one active "
        "scheduler through; empty: no election, this scheduler always serves")
    lease_namespace: str = opt(
        "", "the Lease's namespace (empty: the pod's, from its service account)")
    lease_identity: str = opt(
        "", "this replica's name in the Lease (empty: the host name, i.e. the pod's)")
    lease_api_url: str = opt("https://kubernetes.default.svc", "the Kubernetes API server")
    lease_token_file: str = opt(
        "/var/run/secrets/kubernetes.io/serviceaccount/token",
        "the service account token the election authenticates with (re-read every call)")
    lease_ca_file: str = opt(
        "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
        "CA bundle of the API server (empty: the system's)")
    lease_duration_s: float = opt(
        6.0, "a Lease not renewed this long is taken over by the standby; the leader stops "
        "serving once its renewals have failed for this long minus lease_renew_s",
        min=1.0, max=300.0)
    lease_renew_s: float = opt(
        1.0, "how often the leader renews and the standby looks (at most a third of "
        "lease_duration_s)", min=0.1, max=60.0)
    # -- agents (docs/agents.md) --
    infer_advisories: bool = opt(
        True, "a turn ending in tool calls makes the scheduler advise the session's next "
        "turn itself (expected after the tools' learnt latency); false: only clients advise",
    )
    tool_latency_default_s: float = opt(
        2.0, "a tool's expected latency until a few of its calls were seen", min=0.0,
        max=3600.0,
    )
    tool_latency_quantile: float = opt(
        0.95, "quantile of a tool's latency past which its session's inferred advisory "
        "expires (its device blocks give way)", min=0.5, max=1.0,
    )
    session_headers: list[str] = opt(
        ["x-claude-code-session-id"], "request headers read as the session id when "
        "X-Session-Id is absent (those agent CLIs send), in order",
    )
    retention_in_memory_s: float = opt(
        600.0, "prompt_cache_retention \"in_memory\": seconds the kvstore keeps the session's "
        "KV after its last turn (the kvstore bounds it by its ttl_s)", min=1.0,
        max=7 * 86400.0,
    )
    retention_24h_s: float = opt(
        86400.0, "prompt_cache_retention \"24h\": seconds the kvstore keeps the session's KV "
        "after its last turn (the kvstore bounds it by its ttl_s)", min=1.0, max=7 * 86400.0,
    )
    tpot_default_s: float = opt(
        0.05, "a node's time per output token until measured (when running requests are "
        "expected to end, for placing advisories)", min=0.0001, max=10.0,
    )
