"""Validated OpenAI requests as plain data, independent of HTTP and of protobuf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["chat", "completion"]
InputKind = Literal["chat", "text", "tokens"]


@dataclass(frozen=True)
class ToolCall:
    """A function call: an assistant's in the history, or one the model made."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Guidance:
    """Tools offered and the output's required shape (engine: guidance.py).

    ``tool_choice``: "none" | "auto" | "required" | "function:<name>"."""

    tools_json: str = ""  # the OpenAI tool list as JSON; "" = no tools
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    response_format: str = ""  # "" | "json_object" | "json_schema"
    json_schema: str = ""  # JSON text of the schema for "json_schema"

    @property
    def has_tools(self) -> bool:
        return bool(self.tools_json)


@dataclass(frozen=True)
class Prompt:
    """One input: chat messages, raw text or token ids (exactly one is used, per ``kind``)."""

    kind: InputKind
    text: str = ""
    messages: tuple[Message, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 0  # 0 = up to the context limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's; 1 = off
    min_p: float = 0.0  # vLLM's; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # vLLM's: no EOS or stop token id before this many tokens
    logprobs: int = -1  # -1: none; n: the token's and the n most likely (chat: top_logprobs)
    echo: bool = False  # completions: the prompt's text (and log-probabilities) first


@dataclass(frozen=True)
class Choice:
    """One generation the request fans out to; ``index`` is the OpenAI choice index."""

    index: int
    prompt_index: int
    prompt: Prompt
    seed: int | None


@dataclass(frozen=True)
class ApiRequest:
    endpoint: Endpoint
    model: str | None  # None = the cluster's default model
    prompts: tuple[Prompt, ...]
    sampling: Sampling
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    session_id: str = ""
    tenant: str = "default"
    priority: int = 0
    add_generation_prompt: bool = True
    guidance: Guidance = Guidance()
    ignored_fields: tuple[str, ...] = ()  # body fields nobody documents (a header names them)

    def choices(self) -> list[Choice]:
        """Prompt-major fan-out: choice ``p * n + j`` is sample ``j`` of prompt ``p``.

        Each sample of a seeded request gets its own seed (``seed + j``) so that ``n`` seeded
        samples differ from each other yet stay reproducible.
        """
        out = []
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                seed = None if self.sampling.seed is None else self.sampling.seed + j
                out.append(Choice(p * self.n + j, p, prompt, seed))
        return out
