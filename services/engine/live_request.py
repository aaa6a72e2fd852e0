"""A request the engine core is running: its sequence, the state of its output, its
sampler, and what shapes its tokens (a grammar) and its text (a tool-call parser).

    add_token(t)      a sampled token: appended, checked against the stop conditions and
                      the grammar (the request may finish by it)
    output(tokens)    what its stream gets for this step (``GenerateOutput``)

Worker thread only, like the core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .api_types import GenerateOutput, TokenLogprob, ToolCall
from .output_state import STOP, OutputState
from .sequence import Sequence
from .structured import Constraint
from .tools import ToolCallStream

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LiveRequest:
    seq: Sequence
    output_state: OutputState
    generator: torch.Generator
    sent_prompt: bool = False
    constraint: Constraint | None = None  # the grammar its tokens must follow
    tool_stream: ToolCallStream | None = None  # splits tool calls from content
    # The prompt's tokens with their log-probabilities (echo), gathered over its prefill
    # chunks and sent with the first output; entry i is prompt token i.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.output_state.finish_reason is not None

    def add_token(self, token: int) -> None:
        """Append a sampled token; it may end the request (length, stop, the grammar)."""
        seq, state = self.seq, self.output_state
        seq.token_ids.append(token)
        state.add(token)
        c = self.constraint
        if c is not None and state.finish_reason is None:
            if not c.advance(token):
                log.warning("request %s: grammar refused token %d: %s", seq.request_id,
                            token, c.error)
                state.finish(STOP)
            elif c.done:  # the grammar is complete: nothing may follow
                state.finish(STOP)

    def add_prompt_logprobs(self, index: int, entries: list[TokenLogprob],
                            first: tuple[str, bytes]) -> None:
        """Entries for prompt tokens ``index...``; a recomputed prefill (preemption) may
        bring some again, kept once. ``first``: how the prompt's first token is spelled
        (nothing predicts it: no log-probability)."""
        if not self.prompt_logprobs:
            tid = self.seq.prompt_token_ids[0]
            self.prompt_logprobs.append(TokenLogprob(tid, first[0], first[1], None))
        have = len(self.prompt_logprobs)
        self.prompt_logprobs.extend(entries[max(0, have - index):])

    def output(self, tokens: list[int], logprobs: tuple[TokenLogprob, ...] = ()
               ) -> GenerateOutput:
        """This step's output (the first one also carries the prompt's token ids and where
        its KV came from)."""
        seq, state = self.seq, self.output_state
        first = not self.sent_prompt
        self.sent_prompt = True
        text = state.take_text()
        calls: tuple[ToolCall, ...] = ()
        if self.tool_stream is not None:
            text, found = self.tool_stream.feed(text)
            if state.finish_reason is not None:
                tail, more = self.tool_stream.finish()
                text, found = text + tail, found + more
            calls = tuple(found)
        finish = state.finish_reason
        if finish == STOP and self.tool_stream is not None and self.tool_stream.num_calls:
            finish = "tool_calls"
        return GenerateOutput(
            request_id=seq.request_id,
            text=text,
            tool_calls=calls,
            token_ids=tuple(tokens),
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            finish_reason=finish,
            prompt_token_ids=tuple(seq.prompt_token_ids) if first else (),
            kv_from=kv_from(seq) if first else "",
            logprobs=logprobs,
            prompt_logprobs=tuple(self.prompt_logprobs) if first else (),
        )


def kv_from(seq: Sequence) -> str:
    """Where the prompt's reused KV was: on blocks an advisory prefetched (all of it, or its
    lower layers), loaded ("local", "s3", "peer"), on device, or nowhere ("recompute")."""
    if seq.offload.prefetched:  # "device_prefetched" or "device_partial"
        return seq.offload.prefetched
    if seq.offload.loaded_from:
        return seq.offload.loaded_from
    return "device" if seq.num_cached_tokens else "recompute"
