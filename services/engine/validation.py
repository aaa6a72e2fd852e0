"""Check and tokenize a GenerateRequest before it enters the engine (typed errors only)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from shared.hashing import hash_seed
from shared.libc import trim_heap

from .api_types import GenerateRequest, SamplingParams
from .errors import INVALID_ARGUMENT, NOT_FOUND, EngineError
from .guidance import ModelGuidance
from .input_size import check_input_size
from .structured import Constraint
from .tools import ToolCallStream


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_output_tokens: int
    hash_seed: bytes
    priority: int
    tenant: str = ""
    session_id: str = ""
    kv_source: str = ""  # see GenerateRequest
    kv_source_tokens: int = 0
    no_reuse: bool = False
    device_only: bool = False
    constraint: Constraint | None = None  # the grammar the output must follow
    tool_stream: ToolCallStream | None = None  # lifts tool calls out of the output


# An input this large leaves megabytes of the tokenizer's and the template's scratch freed in
# glibc's arenas: handed back to the kernel after it, so one request does not grow the
# engine's RSS for good.
LARGE_INPUT_CHARS = 1 << 20


def _bad(message: str) -> EngineError:
    return EngineError(INVALID_ARGUMENT, message)


def tokenize(req: GenerateRequest, tokenizer, guidance: ModelGuidance | None = None
             ) -> list[int]:
    given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
    if sum(given) != 1:
        raise _bad("give exactly one of prompt, messages, prompt_token_ids")
    if req.prompt_token_ids is not None:
        return [int(t) for t in req.prompt_token_ids]
    if req.prompt is not None and not req.prompt:
        raise _bad("the prompt is empty")
    try:
        if req.prompt is not None:
            return tokenizer.encode_prompt(req.prompt)
        if not req.messages:
            raise _bad("messages is empty")
        if guidance is not None:
            return guidance.prompt_ids(req)
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        return tokenizer.encode_chat(msgs, add_generation_prompt=req.add_generation_prompt)
    except EngineError:
        raise
    # Templates (jinja2) and tokenizers raise assorted types for input they reject; all
    # of them mean "bad input" here.
    except Exception as e:
        raise _bad(f"cannot tokenize the input: {e}") from None


def check_sampling(p: SamplingParams, vocab_size: int) -> None:
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise _bad(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise _bad(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise _bad(f"top_k must be >= 0 (0 = off), got {p.top_k}")
    if p.max_tokens < 0:
        raise _bad(f"max_tokens must be >= 0 (0 = up to the context limit), got {p.max_tokens}")
    if any(not s for s in p.stop):
        raise _bad("stop strings must not be empty")
    bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise _bad(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    check_processors(p, vocab_size)


def check_processors(p: SamplingParams, vocab_size: int) -> None:
    """The processors' and log-probabilities' ranges (OpenAI's and vLLM's)."""
    for name, v, lo, hi in (("presence_penalty", p.presence_penalty, -2.0, 2.0),
                            ("frequency_penalty", p.frequency_penalty, -2.0, 2.0),
                            ("min_p", p.min_p, 0.0, 1.0)):
        if not (math.isfinite(v) and lo <= v <= hi):
            raise _bad(f"{name} must be in [{lo}, {hi}], got {v}")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise _bad(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty}")
    bad = [t for t, b in p.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise _bad(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                   f"[0, {vocab_size})")
    if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in p.logit_bias):
        raise _bad("logit_bias values must be in [-100, 100]")
    if p.min_tokens < 0 or (p.max_tokens and p.min_tokens > p.max_tokens):
        raise _bad(f"min_tokens must be in [0, max_tokens], got {p.min_tokens}")
    if not (-1 <= p.logprobs <= 20 and -1 <= p.prompt_logprobs <= 20):
        raise _bad("logprobs and prompt_logprobs must be in [0, 20] (-1: none)")


def prepare(
    req: GenerateRequest,
    *,
    tokenizer,
    model_name: str,
    vocab_size: int,
    max_model_len: int,
    fingerprint: str,
    guidance: ModelGuidance | None = None,
) -> PreparedRequest:
    """Validate ``req`` against the model and the context limit; raise EngineError."""
    if req.model and req.model != model_name:
        raise EngineError(
            NOT_FOUND, f"model {req.model!r} is not served here; this engine serves {model_name!r}"
        )
    check_sampling(req.sampling, vocab_size)
    _, chars = check_input_size(req, max_model_len)  # before tokenizing or a grammar
    if guidance is None and not req.guidance.empty:
        raise _bad("tools and response_format need a model with a tokenizer for them")
    try:
        ids = tokenize(req, tokenizer, guidance)
    finally:
        if chars >= LARGE_INPUT_CHARS:
            trim_heap()
    if not ids:
        raise _bad("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise _bad(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    n = len(ids)
    if n > max_model_len - 1:
        raise _bad(
            f"the prompt has {n} tokens but the context limit is {max_model_len} "
            f"(at most {max_model_len - 1} prompt tokens leave room for one output token)"
        )
    room = max_model_len - n
    max_tokens = req.sampling.max_tokens
    if max_tokens > room:
        raise _bad(
            f"max_tokens={max_tokens} exceeds the context: the prompt has {n} tokens, "
            f"the limit is {max_model_len}, so at most {room} can be generated"
        )
    return PreparedRequest(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt_token_ids=ids,
        sampling=req.sampling,
        max_output_tokens=max_tokens or room,
        hash_seed=hash_seed(fingerprint, req.tenant),
        priority=req.priority,
        tenant=req.tenant,
        session_id=req.session_id,
        kv_source=req.kv_source,
        kv_source_tokens=req.kv_source_tokens,
        # The prompt's log-probabilities need every prompt position's logits, so its whole
        # forward runs anyway: reused KV would save nothing, and the request is simplest
        # computed from scratch (docs/api.md, "echo").
        no_reuse=req.no_reuse or req.sampling.prompt_logprobs >= 0,
        device_only=req.device_only,
        constraint=guidance.constraint(req.guidance) if guidance else None,
        tool_stream=guidance.output_stream(req.guidance) if guidance else None,
    )
