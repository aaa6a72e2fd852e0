"""Engine configuration (section ``engine:``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ConfigError, opt, sub
from shared.cpus import parse_cpus
from shared.give_way import CHOICES as GIVE_WAY_CHOICES
from shared.give_way import DEFAULT as DEFAULT_GIVE_WAY


@dataclass(frozen=True)
class OffloadConfig:
    """Section ``engine.offload``: the node's kvstore and the reuse of what it stores."""

    kvstore_address: str = opt(
        "", "the node's kvstore (host:port) for saving and reusing KV; empty = device cache only"
    )
    mode: str = opt(
        "layerwise",
        "how stored KV is reused: layerwise (load overlaps compute), whole_prefix (load, then "
        "compute), recompute (never look up or save; baseline)",
        choices=("layerwise", "whole_prefix", "recompute"),
    )
    policy: str = opt(
        "cost",
        "cost: load a span only when estimated faster than recomputing it; always: load "
        "every stored span (tests, benchmarks)",
        choices=("cost", "always"),
    )
    lookup_timeout_s: float = opt(
        0.2, "LookupPrefix deadline; past it the request recomputes", min=0.001, max=60.0
    )
    peer_lookup_timeout_s: float = opt(
        4.0, "LookupPrefix deadline when the session's KV is on another node (the peer may "
        "wait for its save of the previous turn: keep this above kvstore.peer_wait_s)",
        min=0.001, max=120.0,
    )
    load_timeout_s: float = opt(
        10.0, "a layer not loaded this long after its wait began is recomputed", min=0.01
    )
    save_timeout_s: float = opt(
        30.0, "SaveFromPool deadline (blocks stay pinned until it answers)", min=0.01
    )
    attach_backoff_max_s: float = opt(
        5.0, "longest pause between AttachPool retries while the kvstore is down", min=0.01
    )
    prefill_s_per_token: float = opt(
        1e-3, "prior prefill cost (s/token) until the engine has measured its own", min=0.0
    )
    load_overhead_s: float = opt(
        0.002, "fixed cost of one load (RPC round trips) in the load-or-recompute estimate",
        min=0.0,
    )
    cooperative: bool = opt(
        True, "prefetched blocks give way to running requests (Symphony §3.4); false is an "
        "ablation: they stay until their request comes or the advisory ends"
    )
    purge_order: str = opt(
        "layers", "layers: prefetch fills and purges lower layers of every advised session "
        "before higher layers of any (§3.4); sessions (an ablation): whole sessions, the "
        "least recently advised purged first", choices=("layers", "sessions"),
    )
    prefetch_join_s: float = opt(
        1.0, "a request whose prefix an advisory is loading into the device waits this long "
        "at most for that load instead of loading the KV again", min=0.0, max=30.0,
    )


@dataclass(frozen=True)
class RemapConfig:
    """Section ``engine.remap``: lend whole layers' weight memory to the KV cache under KV
    pressure and stream those layers back ahead of compute (MIRAGE; engine/remap/)."""

    enabled: bool = opt(False, "remap layers' weight memory as KV pages when KV runs out, "
                        "and give it back when the KV it added is empty (float models)")
    max_fraction: float = opt(
        0.5, "most of a model's layers that may be remapped at once (MIRAGE §5.2's "
        "threshold: enough stays resident to start it at once)", min=0.0, max=0.95)
    scheme: str = opt(
        "dynamic", "slots the streamed layers share: single (α+1 layers, one slot), double "
        "(α+2, two slots: double buffering), dynamic (single while Equation 4 holds on the "
        "measured times, else double; MIRAGE §7.5's C)", choices=("dynamic", "single", "double"))
    capped: bool = opt(
        True, "also cap the remapped layers at what the measured copy and compute times "
        "can hide (MIRAGE §5.3, §7.6.2); false: max_fraction alone")
    node_grace_s: float = opt(
        0.3, "on a node's shared budget: how long KV must stay short before this engine "
        "lends its own layers, so that the node's broker first takes back idle engines' "
        "pages and inactive models' weights (the give-way order); 0 = at once",
        min=0.0, max=10.0)
    give_way: str = opt(
        DEFAULT_GIVE_WAY, "what gives way when KV runs out, first first: the three of "
        "prefetched_kv (advised sessions' prefetched KV, later layers first; Symphony §3.4), "
        "idle_weights (idle models' weights: the Reuse Store's, and idle engines' layers "
        "lent to the node), active_weights (active models' layers, lowest priority first); "
        "the node's broker and prefetcher follow the order its engines report "
        "(shared/give_way.py); prefetch_first and weights_first name the default and "
        "idle_weights,active_weights,prefetched_kv", choices=GIVE_WAY_CHOICES)


@dataclass(frozen=True)
class EngineConfig:
    host: str = opt("127.0.0.1", "address the Engine gRPC server binds to")
    port: int = opt(50053, "Engine gRPC port (0 = pick a free port)", min=0, max=65535)
    metrics_port: int = opt(0, "Prometheus /metrics HTTP port (0 = off)", min=0, max=65535)
    model_path: str = opt(
        "", "local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
    )
    served_model_name: str = opt("", "name clients use for the model; default: the folder name")
    dtype: str = opt("bfloat16", "weights and KV dtype; q8_0 / q4: int8 / int4 weights (a "
                     "GGUF's quantized ones as they are), float32 activations and KV",
                     choices=("bfloat16", "float16", "float32", "q8_0", "q4"))
    device: str = opt("cpu", "torch device; 'cuda' uses the CUDA seam", choices=("cpu", "cuda"))
    block_size: int = opt(16, "tokens per KV block (one layer per block)", min=1, max=1024)
    device_memory_bytes: int = opt(
        1 << 30, "device-memory budget for the KV pool (on CPU it stands in for HBM)", min=1 << 20
    )
    page_bytes: int = opt(2 << 20, "KV capacity grows and shrinks in pages of this size", min=4096)
    standby: bool = opt(
        False, "start without a model and wait among the node's standby engines for one to "
        "be activated (Prism §5.2); model_path, if given, is served first all the same")
    device_ledger: str = opt(
        "", "the node's shared device-memory ledger (a file the nodemgr creates): KV pages "
        "and weights count against one budget with the node's other engines; '' = "
        "device_memory_bytes is this engine's own")
    kv_reserve_bytes: int = opt(
        0, "with a device ledger: KV memory the node's other engines may not take from "
        "this one while it holds less (Prism §6.3's buffer per engine: a model that turns "
        "hot starts at once); 0 = none", min=0)
    max_num_seqs: int = opt(64, "most sequences running in one step", min=1, max=4096)
    max_num_batched_tokens: int = opt(
        512, "token budget per step (prefill chunks + decodes)", min=1, max=1 << 20
    )
    max_model_len: int = opt(0, "context limit in tokens; 0 = the model's own", min=0)
    max_waiting: int = opt(1024, "queued requests before new ones are refused", min=1)
    max_queue_delay_s: float = opt(
        0.5, "refuse a new request (HTTP 429 upstream) that would wait longer than this for "
        "a seat, judged by the queue ahead of it and the rate the queue drains at; "
        "0 = only max_waiting bounds the queue", min=0.0,
    )
    stream_keepalive_s: float = opt(
        1.0, "a stream with nothing to send this long gets an empty keepalive message, so "
        "that the scheduler can tell a busy engine from a stopped one (keep it well below "
        "scheduler.stream_idle_timeout_s)", min=0.05, max=60.0,
    )
    max_step_s: float = opt(
        60.0, "a forward step running longer than this is taken as stuck: streams stop "
        "sending keepalives, so the scheduler cuts them", min=1.0,
    )
    num_threads: int = opt(
        0, "torch intra-op threads; 0 = one per core of `cpus`, else torch's default",
        min=0, max=1024,
    )
    cpus: str = opt(
        "", "cores this engine runs on, e.g. '0-3' or '0,2' (CPU affinity of every thread); "
        "empty = all; `overture up` gives each node its share"
    )
    seed: int = opt(0, "global seed for requests that give none", min=0)
    tool_parser: str = opt(
        "", "tool-call format (hermes | llama3_json | mistral); '' = from the chat template",
        choices=("", "hermes", "llama3_json", "mistral"),
    )
    debug_checks: bool = opt(False, "check KV allocator integrity after every step (slow)")
    debug_die_on_sigusr1: bool = opt(
        False, "fault injection for tests: after a SIGUSR1 the engine crashes during its next "
        "generation request, once its stream has started and before any token (the request "
        "fails UNKNOWN, the process exits 70); never set in production")
    offload: OffloadConfig = sub(
        OffloadConfig, "KV kept off the device: the node's kvstore and how it is reused"
    )
    remap: RemapConfig = sub(RemapConfig, "weight memory lent to the KV cache (MIRAGE)")

    # One release of grace for the flat names these options had before ``offload``, and
    # for ``pool`` (the KV pool is the only pool of an engine now).
    DEPRECATED_KEYS: ClassVar[dict[str, str]] = {
        "pool": "standby",
        "kvstore_address": "offload.kvstore_address",
        "reuse_mode": "offload.mode",
        "reuse_policy": "offload.policy",
        "kvstore_lookup_timeout_s": "offload.lookup_timeout_s",
        "kvstore_load_timeout_s": "offload.load_timeout_s",
        "kvstore_save_timeout_s": "offload.save_timeout_s",
        "kvstore_attach_backoff_max_s": "offload.attach_backoff_max_s",
        "reuse_prefill_s_per_token": "offload.prefill_s_per_token",
        "reuse_load_overhead_s": "offload.load_overhead_s",
    }

    @property
    def threads(self) -> int:
        """Intra-op threads to use: ``num_threads``, else one per pinned core (0: torch's
        default)."""
        return self.num_threads or len(parse_cpus(self.cpus))

    def validate(self) -> None:
        parse_cpus(self.cpus)  # CpuListError (a ConfigError) when it does not parse
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(
                "engine.max_num_batched_tokens: must be at least engine.block_size "
                f"({self.block_size}); raise it"
            )
