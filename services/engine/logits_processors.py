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


class TokenTally:
    """A row's running tally for the penalties: the distinct tokens it has seen (prompt and
    output) and how often each output token occurs, brought up to date with only the tokens
    appended since the last step, so a step costs O(new tokens), not O(context). Kept on
    the live request; token ids only ever grow (a preempted request keeps its tokens)."""

    __slots__ = ("_out", "_out_ids", "_seen", "_seen_ids", "_synced")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._seen: dict[int, None] = {}  # distinct tokens, in first-seen order
        self._out: dict[int, int] = {}  # output token -> count
        self._synced = 0
        self._seen_ids: torch.Tensor | None = None
        self._out_ids: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, token_ids: Sequence[int], num_prompt: int) -> None:
        n = len(token_ids)
        if n < self._synced:  # not this row's history: start again
            self._reset()
        for j in range(self._synced, n):
            t = token_ids[j]
            if t not in self._seen:
                self._seen[t] = None
                self._seen_ids = None
            if j >= num_prompt:
                self._out[t] = self._out.get(t, 0) + 1
                self._out_ids = None
        self._synced = n

    def seen(self) -> torch.Tensor:
        """The distinct tokens seen, int64 (cached until a new one comes)."""
        if self._seen_ids is None:
            self._seen_ids = torch.tensor(list(self._seen), dtype=torch.int64)
        return self._seen_ids

    def output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct output tokens (int64) and their counts (float32)."""
        if self._out_ids is None:
            self._out_ids = (torch.tensor(list(self._out), dtype=torch.int64),
                             torch.tensor(list(self._out.values()), dtype=torch.float32))
        return self._out_ids


class History:
    """The tokens a row has seen: ``token_ids`` (prompt then output) and where the output
    starts; ``banned``: the tokens ``min_tokens`` holds back now (EOS, stop token ids);
    ``tally``: the row's running ``TokenTally`` (the engine keeps one per request; without
    it one is built from ``token_ids``)."""

    __slots__ = ("banned", "num_prompt", "tally", "token_ids")

    def __init__(self, token_ids: Sequence[int], num_prompt: int,
                 banned: Sequence[int] = (), tally: TokenTally | None = None) -> None:
        self.token_ids = token_ids
        self.num_prompt = num_prompt
        self.banned = banned
        self.tally = tally if tally is not None else TokenTally()


def apply_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[History] | None) -> None:
    """Process ``logits`` (S, V) float32 contiguous in place, only the rows whose params ask
    for it. Every kind of processor is one indexed op over all its rows (the flat index
    row * V + token), in the order of the table above: the cost is per token touched, not
    per vocabulary entry, and does not grow with the number of Python calls per row."""
    v = logits.shape[-1]
    flat = logits.view(-1)
    rows = [i for i, p in enumerate(params) if p.processed]
    bias = [(i * v + t, b) for i in rows for t, b in params[i].logit_bias]
    if bias:
        flat.index_add_(0, torch.tensor([k for k, _ in bias], dtype=torch.int64),
                        torch.tensor([b for _, b in bias], dtype=flat.dtype))
    if histories is None:
        return
    rep_idx, rep_r, pen_idx, pen_val = [], [], [], []
    for i in rows:
        p, h = params[i], histories[i]
        if h.banned:
            _ban(logits[i], torch.tensor(h.banned, dtype=torch.int64))
        if p.repetition_penalty == 1.0 and not (p.frequency_penalty or p.presence_penalty):
            continue
        h.tally.update(h.token_ids, h.num_prompt)
        if p.repetition_penalty != 1.0 and h.token_ids:
            seen = h.tally.seen()
            rep_idx.append(seen + i * v)
            rep_r.append(torch.full((len(seen),), p.repetition_penalty, dtype=flat.dtype))
        if (p.frequency_penalty or p.presence_penalty) and len(h.token_ids) > h.num_prompt:
            ids, counts = h.tally.output_counts()
            pen_idx.append(ids + i * v)
            pen_val.append(-(p.frequency_penalty * counts + p.presence_penalty))
    if rep_idx:
        idx, r = torch.cat(rep_idx), torch.cat(rep_r)
        vals = flat[idx]
        flat[idx] = torch.where(vals > 0, vals / r, vals * r)
    if pen_idx:
        flat.index_add_(0, torch.cat(pen_idx), torch.cat(pen_val).to(flat.dtype))


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
