"""Log-probabilities in OpenAI's two shapes, from the engine's per-token entries.

    chat (/v1/chat/completions):
      {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
       "bytes"}]}], "refusal": null}
    legacy (/v1/completions):
      {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
       "text_offset": [...]}   text_offset: where each token's text starts in the choice's
                               text (the echoed prompt counts; streamed, it carries on)

A streamed chunk carries the entries of its own tokens; the whole response, all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.scheduler.api.chunk import TokenLogprob


def chat_logprobs(entries: Sequence[TokenLogprob], top: bool = True) -> dict[str, Any]:
    """``top``: with the ``top_logprobs`` lists (top_logprobs 0 still gives empty ones)."""
    return {"content": [_chat_entry(t, top) for t in entries], "refusal": None}


def _chat_entry(t: TokenLogprob, top: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"token": t.token, "logprob": t.logprob, "bytes": list(t.raw)}
    if top:
        out["top_logprobs"] = [{"token": tok, "logprob": lp, "bytes": list(raw)}
                               for tok, raw, lp in t.top]
    return out


def legacy_logprobs(entries: Sequence[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """The legacy object of ``entries`` whose text starts at ``offset``; and the offset
    after them."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for t in entries:
        tokens.append(t.token)
        lps.append(t.logprob)
        offsets.append(offset)
        offset += len(t.token)
        if t.logprob is None:  # the prompt's first token: OpenAI gives null for both
            tops.append(None)
            continue
        # OpenAI's dict holds the n most likely and the sampled token too.
        top = {tok: lp for tok, _, lp in t.top}
        top.setdefault(t.token, t.logprob)
        tops.append(top)
    obj = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
           "text_offset": offsets}
    return obj, offset
