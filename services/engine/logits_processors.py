"""Per-request logits processors: logit bias and the penalties, row by row.

Applied to the raw logits of the rows that ask for them, before temperature, in vLLM's
order (logit bias, then the repetition, frequency and presence penalties); min-p comes
after temperature, with top-k and top-p (``sampling.py``). Each one changes only its own
row, so a batch mixing penalized and plain requests samples the plain ones exactly as it
would without the others.

    logit_bias          l[t] += bias[t]                                   (OpenAI)
    min_tokens          l[t] = -inf for EOS and stop token ids while the output is
                        shorter (unless nothing else is allowed: a grammar's end)  (vLLM)
    repetition_penalty  l[t] = l[t] / r if l[t] > 0 else l[t] * r,
                        for every t in the prompt or the output            (vLLM, CTRL)
    frequency_penalty   l[t] -= f * count_out(t)                          (OpenAI)
    presence_penalty    l[t] -= p * [count_out(t) > 0]                    (OpenAI)

OpenAI's penalties count the output so far ("the text so far" of the completion), as
vLLM does; the repetition penalty counts the prompt too. A token a grammar forbids stays
at -inf under every one of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .api_types import SamplingParams


class History:
    """The tokens a row has seen: ``token_ids`` (prompt then output) and where the output
    starts; ``banned``: the tokens ``min_tokens`` holds back now (EOS, stop token ids)."""

    __slots__ = ("banned", "num_prompt", "token_ids")

    def __init__(self, token_ids: Sequence[int], num_prompt: int,
                 banned: Sequence[int] = ()) -> None:
        self.token_ids = token_ids
        self.num_prompt = num_prompt
        self.banned = banned


def apply_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[History] | None) -> None:
    """Process ``logits`` (S, V) float32 in place, only the rows whose params ask for it."""
    v = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.processed:
            continue
        row = logits[i]  # (V,) a view: edits land in ``logits``
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype))
        if histories is None:
            continue
        h = histories[i]
        if h.banned:
            _ban(row, torch.tensor(h.banned, dtype=torch.int64))
        if p.repetition_penalty != 1.0 and h.token_ids:
            seen = torch.tensor(h.token_ids, dtype=torch.int64).unique()
            vals = row[seen]
            r = p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / r, vals * r)
        out = h.token_ids[h.num_prompt:]
        if (p.frequency_penalty or p.presence_penalty) and out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=v)[:v]
            counts = counts.to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _ban(row: torch.Tensor, ids: torch.Tensor) -> None:
    kept = row[ids].clone()
    row[ids] = float("-inf")
    if not bool(torch.isfinite(row).any()):  # only an end was allowed (a grammar's): keep it
        row[ids] = kept


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Boolean mask (S, V) of the tokens to DROP by min-p (vLLM): those less likely than
    ``min_p`` (S,) times the row's most likely token (0 = off)."""
    top = probs.max(dim=-1, keepdim=True).values  # (S, 1)
    return probs < min_p[:, None] * top
