"""Plain dataclasses of the engine's public API (in-process and, via wire.py, gRPC)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.model_info import ModelInfo

from .wait_forecast import QueueShape


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_tokens: int = 0  # 0 = up to the context limit
    seed: int | None = None  # None = drawn from the engine's seed
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processors (logits_processors.py), each off at its default: OpenAI's
    # penalties over the output so far, vLLM's repetition penalty (prompt and output) and
    # min-p, and a bias added to given token ids ((id, bias) pairs, -100..100).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # vLLM's: no EOS or stop token id before this many output tokens
    # Log-probabilities (logprobs.py): -1 = none; n >= 0 = the sampled token's and the n
    # most likely alternatives'. ``prompt_logprobs`` does the same for the prompt's own
    # tokens (OpenAI's ``echo``), computed in prefill.
    logprobs: int = -1
    prompt_logprobs: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether any logits processor changes this request's distribution."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position; ``text`` and ``raw`` (its bytes) as the
    tokenizer spells the token alone."""

    token_id: int
    text: str
    raw: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token of the output (or the prompt) with its log-probability (None: the prompt's
    first token, which nothing predicts) and the most likely tokens at its position."""

    token_id: int
    text: str
    raw: bytes
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A function call in an assistant message or in the output; ``arguments`` is JSON."""

    id: str
    name: str
    arguments: str
    index: int = 0  # its position among the output's calls (streamed deltas)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool result: the call it answers
    name: str = ""


@dataclass(frozen=True)
class Guidance:
    """The tools a prompt offers and the shape the output must take (tools/, structured/).

    ``tool_choice``: "none" | "auto" | "required" | "function:<name>";
    ``response_format``: "" | "json_object" | "json_schema" (with ``json_schema``)."""

    tools: tuple[dict, ...] = ()  # OpenAI function tools: {"type": "function", "function"}
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    response_format: str = ""
    json_schema: dict | None = None

    @property
    def empty(self) -> bool:
        return not self.tools and not self.response_format

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of ``prompt``, ``messages``, ``prompt_token_ids`` is the input."""

    request_id: str = ""
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""  # "" = the engine's only model
    session_id: str = ""
    tenant: str = ""
    priority: int = 0
    add_generation_prompt: bool = True
    kv_source: str = ""  # the kvstore holding the session's KV when not this node's
    kv_source_tokens: int = 0  # the length of the turn saved there
    no_reuse: bool = False  # reuse no KV (device cache or kvstore) and save none (baseline)
    device_only: bool = False  # reuse only the device cache; no kvstore load or save
    cache_retention_s: float = 0.0  # the kvstore keeps the session this long (0: its TTLs)
    guidance: Guidance = field(default_factory=Guidance)
    node_admitted: bool = False  # the node's deadline queue started it: no delay refusal
    waited_s: float = 0.0  # waited before the engine got it (counted against the queue limit)


@dataclass(frozen=True)
class GenerateOutput:
    """One streamed piece. The first carries ``prompt_token_ids``; the last ``finish_reason``."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_token_ids: tuple[int, ...] = ()
    kv_from: str = ""  # the first piece: "device", "local", "peer", "s3" or "recompute"
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed in this piece
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of ``token_ids`` (if asked)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first piece: one per prompt token


@dataclass(frozen=True)
class ReuseStats:
    """KV reuse since start: prompt tokens whose KV was on device, loaded from a kvstore
    tier, or computed; loads that failed (and were recomputed); kvstore calls."""

    mode: str = "recompute"
    attached: bool = False  # the pool is attached to the node's kvstore now
    device_tokens: int = 0
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # by tier
    recomputed_tokens: int = 0
    load_failures: int = 0
    lookups: int = 0
    lookup_errors: int = 0
    saves: int = 0
    save_errors: int = 0
    chunks_saved: int = 0
    last_load_seconds: float = 0.0  # the latest load, from admission to its last layer
    # The engine's measured prefill cost, which load-or-recompute weighs loads against.
    prefill_s_per_token: float = 0.0
    prefetch: PrefetchStats | None = None  # advised sessions prefetched into the device


@dataclass
class PrefetchStats:
    """Advised sessions prefetched into the device (offload/device_prefetch/)."""

    sessions: int = 0  # advised sessions in the book now
    blocks_held: int = 0  # resident (indexed) and being loaded
    blocks_resident: int = 0
    loaded_bytes: int = 0  # copied into the device by prefetch, ever
    wasted_bytes: int = 0  # of those, in sessions that expired, were invalidated or replaced
    purged_blocks_by_layer: list[int] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)  # followed, expired, ...


@dataclass(frozen=True)
class RemapStatus:
    """Weight memory lent to the KV cache (MIRAGE, engine/remap/): ``alpha`` layers lent
    now, streamed through ``slots`` slots (``layers``); counters since start."""

    alpha: int
    slots: int
    layers: tuple[int, ...]
    lent_bytes: int
    remaps: int
    reversions: int
    transfers: int
    transfer_s: float
    step_transfer_s: float  # the last forward's copies
    stalled_forwards: int  # forwards a copy made wait
    node_layers: int = 0  # of alpha, layers lent to the node's budget (other engines' KV)
    node_lent_bytes: int = 0
    lendable_layers: int = 0  # more it may lend now
    layer_bytes: int = 0
    give_way: str = ""  # the order memory gives way in (shared/give_way.py)


@dataclass(frozen=True)
class EngineStatus:
    """``blocks_total`` is the whole budget; ``free`` counts uncommitted blocks too, so
    ``free + used + evictable == total``."""

    models: tuple[ModelInfo, ...]
    blocks_total: int
    blocks_free: int
    blocks_used: int
    blocks_evictable: int
    blocks_committed: int
    running: int
    waiting: int
    device_budget_bytes: int
    block_bytes: int
    device: str
    pool_name: str
    preemptions: int = 0  # since start
    oldest_waiting_since: float = 0.0  # time.monotonic() the oldest queued request queued
    step_started: float = 0.0  # time.monotonic() the step under way began (0.0: idle)
    admitted: int = 0  # sequences that left the waiting queue for a seat, since start
    reuse: ReuseStats = field(default_factory=ReuseStats)
    queue: QueueShape = field(default_factory=QueueShape)  # what admission forecasts from
    remap: RemapStatus | None = None  # None: remapping off


def merge_outputs(a: GenerateOutput, b: GenerateOutput) -> GenerateOutput:
    """Two consecutive outputs of one request as one (``b`` the later)."""
    return GenerateOutput(
        request_id=a.request_id, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
        prompt_tokens=b.prompt_tokens, completion_tokens=b.completion_tokens,
        cached_tokens=b.cached_tokens or a.cached_tokens, finish_reason=b.finish_reason,
        prompt_token_ids=a.prompt_token_ids or b.prompt_token_ids,
        kv_from=a.kv_from or b.kv_from, tool_calls=a.tool_calls + b.tool_calls,
        logprobs=a.logprobs + b.logprobs, prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs)
