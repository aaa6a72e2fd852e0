"""Shape generations as OpenAI objects: streamed chunks (SSE) and whole responses."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.api.chunk import Chunk, TokenLogprob, ToolCallOut
from services.scheduler.api.logprobs_format import chat_logprobs, legacy_logprobs
from services.scheduler.api.request import Endpoint

SSE_DONE = b"data: [DONE]\n\n"
_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def new_id(endpoint: Endpoint) -> str:
    return _ID_PREFIX[endpoint] + uuid.uuid4().hex


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_from: str = ""  # where the reused KV came from (the engine's label; issue 41)
    finish_reason: str | None = None
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    echo: str | None = None  # the prompt's text to put first (None: no echo)
    text_offset: int = 0  # streamed legacy log-probabilities: the next token's offset

    def add(self, chunk: Chunk) -> None:
        self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
            if self.echo == "":  # a token-id prompt: its tokens spell it
                self.echo = "".join(t.token for t in chunk.prompt_logprobs)
        if chunk.text:
            self.text.append(chunk.text)
        self.tool_calls.extend(chunk.tool_calls)
        self.token_ids.extend(chunk.token_ids)
        if chunk.prompt_token_ids:
            self.prompt_token_ids = chunk.prompt_token_ids
        self.prompt_tokens = max(
            self.prompt_tokens, chunk.prompt_tokens, len(self.prompt_token_ids)
        )
        self.completion_tokens = max(
            self.completion_tokens, chunk.completion_tokens, len(self.token_ids)
        )
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.kv_from = self.kv_from or chunk.kv_from
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason


def usage(states: list[ChoiceState]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (as OpenAI does for ``n``); completions add up.
    A prompt's cached tokens are its least-cached choice's: the ``n`` choices of a prompt
    run side by side, and a later one may reuse what an earlier one just computed, which
    was not in the cache when the request came."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    for s in states:
        prompt_tokens[s.prompt_index] = max(prompt_tokens.get(s.prompt_index, 0), s.prompt_tokens)
        cached[s.prompt_index] = min(cached.get(s.prompt_index, s.cached_tokens),
                                     s.cached_tokens)
    p = sum(prompt_tokens.values())
    c = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values()),
                                  **kv_source(states)},
    }


def kv_source(states: list[ChoiceState]) -> dict[str, str]:
    """Where the first choice's reused KV came from, when it reused any: device,
    device_prefetched (an advisory's), device_partial, local (the node's DRAM or SSD),
    peer or s3."""
    s = states[0] if states else None
    if s is None or not s.cached_tokens or s.kv_from in ("", "recompute"):
        return {}
    return {"kv_from": s.kv_from}


@dataclass(frozen=True)
class Envelope:
    """The fields every object of one response shares."""

    endpoint: Endpoint
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def stream_chunk(
    env: Envelope,
    index: int,
    *,
    text: str = "",
    role: bool = False,
    finish_reason: str | None = None,
    token_ids: tuple[int, ...] | None = None,
    prompt_token_ids: tuple[int, ...] | None = None,
    include_usage: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk for choice ``index`` (a role header, a text delta, tool call
    deltas or the finish), with its tokens' ``logprobs`` (logprobs_format.py)."""
    if env.endpoint == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text}
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    extra = {"usage": None} if include_usage else {}
    return env.wrap(_CHUNK_OBJECT[env.endpoint], [choice], **extra)


def tool_call_deltas(call: ToolCallOut) -> list[list[dict[str, Any]]]:
    """A call as OpenAI streams it: its id and name first, then its arguments."""
    return [
        [{"index": call.index, "id": call.id, "type": "function",
          "function": {"name": call.name, "arguments": ""}}],
        [{"index": call.index, "function": {"arguments": call.arguments}}],
    ]


def tool_calls_json(calls: list[ToolCallOut]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def usage_chunk(env: Envelope, states: list[ChoiceState]) -> dict[str, Any]:
    """The final chunk of a stream with ``stream_options.include_usage``: no choices."""
    return env.wrap(_CHUNK_OBJECT[env.endpoint], [], usage=usage(states))


def full_response(
    env: Envelope, states: list[ChoiceState], return_token_ids: bool, logprobs: bool = False
) -> dict[str, Any]:
    """``logprobs``: each choice carries its tokens' log-probabilities (and the echoed
    prompt's, first)."""
    choices = []
    for s in sorted(states, key=lambda s: s.index):
        text = (s.echo or "") + "".join(s.text)
        if env.endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if s.tool_calls:
                message["tool_calls"] = tool_calls_json(s.tool_calls)
                message["content"] = text or None
            choice: dict[str, Any] = {"index": s.index, "message": message}
        else:
            choice = {"index": s.index, "text": text}
        choice["logprobs"] = None
        if logprobs and env.endpoint == "chat":
            choice["logprobs"] = chat_logprobs(s.logprobs)
        elif logprobs:
            entries = [*s.prompt_logprobs, *s.logprobs] if s.echo is not None else s.logprobs
            choice["logprobs"] = legacy_logprobs(entries, 0)[0]
        choice["finish_reason"] = s.finish_reason or "stop"
        if return_token_ids:
            choice["token_ids"] = list(s.token_ids)
            choice["prompt_token_ids"] = list(s.prompt_token_ids)
        choices.append(choice)
    return env.wrap(_OBJECT[env.endpoint], choices, usage=usage(states))
