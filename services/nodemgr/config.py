"""Node manager configuration (section ``nodemgr:``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass(frozen=True)
class NodeManagerConfig:
    host: str = opt("127.0.0.1", "address the NodeManager gRPC server binds to")
    port: int = opt(50052, "NodeManager gRPC port (0 = pick a free port)", min=0, max=65535)
    metrics_port: int = opt(0, "Prometheus /metrics HTTP port (0 = off)", min=0, max=65535)
    metrics_targets: list[str] = opt(
        [], "the node's other services' /metrics as service=host:port (e.g. "
        "kvstore=127.0.0.1:9101), reported to the scheduler with the nodemgr's own so "
        "GET /admin/nodes lists them; overture up sets it")
    advertise_address: str = opt("", "host:port the scheduler should dial; default host:port")
    node_id: str = opt("node-0", "unique id of this node in the cluster")
    scheduler_address: str = opt("127.0.0.1:50051", "Scheduler gRPC address")
    engine_address: str = opt("127.0.0.1:50053", "this node's Engine gRPC address")
    engine_addresses: list[str] = opt(
        [], "the node's engines when it serves several models, one engine each (replaces "
        "engine_address)")
    device_ledger: str = opt(
        "", "the node's device-memory ledger its engines share (engine.device_ledger): "
        "with it the nodemgr reclaims idle engines' KV pages for busy ones")
    broker_interval_s: float = opt(0.1, "how often the memory broker looks", min=0.01)
    broker_idle_interval_s: float = opt(
        1.0, "how often it looks while no engine of the node has a request", min=0.01)
    lend_weights: bool = opt(
        True, "with a device ledger: when an engine waits for KV pages and none came back, "
        "ask the engines with nothing waiting to lend layers' weight memory to the node's "
        "budget, idle models first, then active ones lowest catalogue priority first "
        "(MIRAGE §5.2; engines with engine.remap.enabled and float weights)")
    lend_revert_after_s: float = opt(
        1.0, "lent layers are taken back once no engine of the node has waited for KV "
        "pages this long (and as far as the budget has the bytes free)", min=0.0, max=600.0)
    models_config: str = opt(
        "", "YAML file whose models: list is the cluster's catalogue: a request for one of "
        "them that no engine here serves activates it into an empty engine of the node, or "
        "one whose model is evicted for it")
    evict_idle_s: float = opt(
        30.0, "a model idle this long may be evicted when another needs its engine or "
        "memory (the loosest TTFT SLO first)", min=0)
    admission_depth: int = opt(
        4, "with several engines: requests an engine may have started and not yet answered "
        "with a first token, the others waiting in the node's queue ordered by TTFT "
        "deadline (Prism §6.3); 0 = off (each engine's own queue)", min=0)
    admission_max_waiting: int = opt(
        1024, "requests the node's deadline queue holds at most; more are refused (429)",
        min=1)
    admission_max_delay_s: float = opt(
        0.5, "with several engines: a new request whose predicted wait in the node's queue "
        "(the prefill queued ahead for its engine, or the oldest's age) is over this is "
        "refused (429 upstream), as an engine's max_queue_delay_s does; 0 = off", min=0.0)
    prefill_tokens_per_s: float = opt(
        2000.0, "a model's chunked-prefill speed until measured (for the deadline order)",
        min=1)
    activation_wait_s: float = opt(
        60.0, "how long a request for an inactive model waits for an engine to be freed "
        "before it fails", min=0.1)
    kvstore_address: str = opt("127.0.0.1:50054", "this node's KVStore gRPC address")
    heartbeat_interval_s: float = opt(1.0, "seconds between heartbeats", min=0.05, max=60)
    engine_wait_s: float = opt(300.0, "how long to wait for the engine at start-up", min=1)
    engine_status_timeout_s: float = opt(2.0, "deadline of one engine Status call", min=0.05)
    engine_stall_s: float = opt(
        120.0, "an engine whose forward step has run this long is reported unable to serve "
        "(it answers Status, but makes no progress)", min=1.0,
    )
    prefetch_timeout_s: float = opt(
        30.0, "deadline of one advisory prefetch into the kvstore's DRAM", min=0.1,
    )
    kvstore_probe_timeout_s: float = opt(
        1.0, "deadline of the per-beat kvstore health check; past it the node is degraded",
        min=0.05,
    )
    register_backoff_max_s: float = opt(
        2.0, "longest pause between registration attempts (each pause jittered to 50-100% "
        "of its value)", min=0.05
    )
    held_sessions_max: int = opt(
        100_000, "sessions saved here that the node remembers and reports when it "
        "registers (a restarted scheduler rebuilds its session directory from them)", min=1)
    reuse_store_bytes: int = opt(
        0, "the node's weight arena (Tangram Reuse Store): catalogue models activate "
        "through it, their tensors shared across models by fingerprint and kept resident "
        "after eviction while room allows; in bytes, counted in the device ledger's "
        "budget when there is one; 0 = off (each engine loads a private copy)", min=0)
    reuse_store_dir: str = opt(
        "", "folder of the arena's shared-memory file ('' = /dev/shm)")
    weights_dtype: str = opt(
        "bfloat16", "the engines' serving dtype (engine.dtype), which the Reuse Store "
        "stores tensors in", choices=("bfloat16", "float16", "float32"))
    weights_device: str = opt(
        "cpu", "the engines' device (engine.device), where the Reuse Store's arena lives: "
        "'cpu' a shared-memory file; 'cuda' GPU memory shared through CUDA's virtual memory "
        "API (untested)", choices=("cpu", "cuda"))
    reuse_release_bytes: int = opt(
        16 << 20, "bytes of inactive models' tensors the memory broker evicts per round "
        "while an engine waits for KV pages and no idle engine's pages could be taken "
        "back (Tangram §3.3)", min=1)
