"""One streamed piece of a generation as plain data: what ``wire.chunk`` makes of a node's
``GenerateChunk``, what the dispatcher yields and what the OpenAI shapes are built from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a generation (see ``GenerateChunk``)."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    cached_tokens: int = 0
    kv_from: str = ""  # the first chunk: where the prompt's KV came from
    node: str = ""  # the node that produced it (set by the dispatcher)
    tool_calls: tuple[ToolCallOut, ...] = ()  # calls completed in this piece
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of ``token_ids``, if asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first chunk, if asked (echo)


@dataclass(frozen=True)
class ToolCallOut:
    """A tool call the model made, whole; ``index`` is its place among the choice's calls."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability (None: a prompt's first token) and the most likely
    tokens at its position, each ``(token, bytes, logprob)``."""

    token: str
    raw: bytes
    logprob: float | None
    top: tuple[tuple[str, bytes, float], ...] = ()
