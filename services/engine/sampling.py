"""Token sampling: greedy, temperature, top-k, top-p, min-p, with one torch.Generator per
request, after the grammar's mask and the logits processors (``logits_processors.py``);
the log-probabilities a request asks for.

Every row is processed on its own numbers (row-wise ops only) and draws from its own
generator, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .api_types import SamplingParams
from .logits_processors import History, apply_processors, min_p_mask


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def top_k_top_p_mask(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Boolean mask (S, V) of the tokens to DROP. ``top_k`` (S,) int, 0 = off; ``top_p`` (S,)
    float, 1 = off. Top-p keeps the smallest prefix of tokens (by probability) whose mass
    reaches p, and always the most likely token."""
    s, v = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V) each
    ranks = torch.arange(v, device=logits.device).expand(s, v)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    drop_sorted = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted |= mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False
    return torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)


@dataclass(frozen=True)
class RowLogprobs:
    """A sampled token's log-probability and the ``k`` most likely tokens', as numbers
    (the core spells them: ``token_text.py``)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Sampled:
    tokens: list[int]
    logprobs: list[RowLogprobs | None]  # per row; None where not asked for


def log_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(S, V) log-probabilities of processed ``logits`` at ``temperature`` (S,) (0: greedy,
    whose distribution is the logits' own, as at temperature 1)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return (logits / t[:, None]).log_softmax(dim=-1)


def row_logprobs(lp: torch.Tensor, token: int, k: int) -> RowLogprobs:
    """``lp`` (V,): the token's value and the top ``k`` (a forbidden token's -inf becomes
    OpenAI's -9999.0, JSON having no infinity)."""
    if not k:
        return RowLogprobs(token, max(float(lp[token]), FLOOR), (), ())
    top = lp.topk(k)  # (only the values read are floored: no copy of the row)
    return RowLogprobs(token, max(float(lp[token]), FLOOR), tuple(top.indices.tolist()),
                       tuple(max(v, FLOOR) for v in top.values.tolist()))


FLOOR = -9999.0


class Sampler:
    """``run(logits, params, generators, ...)`` -> the tokens and, where asked, their
    log-probabilities; ``sample`` -> the tokens only."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[int]:
        return self.run(logits, params, generators, masks).tokens

    def run(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        masks: Sequence[torch.Tensor | None] | None = None,
        histories: Sequence[History] | None = None,
    ) -> Sampled:
        """logits (S, V) float32; ``masks[i]`` (V,) bool, when not None: the tokens row
        ``i`` may take; ``histories[i]``: row ``i``'s tokens so far (for the penalties).
        Only masked or processed rows are touched (a copy), so the other rows sample
        exactly what they would in a batch without them.

        Log-probabilities are of the distribution sampled from, after the grammar's mask,
        the processors and temperature (OpenAI's definition), before truncation by top-k,
        top-p and min-p (which would leave -inf for most of the vocabulary)."""
        processed = any(p.processed for p in params)
        if processed or (masks is not None and any(m is not None for m in masks)):
            logits = logits.clone()
        if masks is not None:
            for i, m in enumerate(masks):
                if m is not None and bool(m.any()):
                    logits[i].masked_fill_(~m, float("-inf"))
        if processed:
            apply_processors(logits, params, histories)
        out = logits.argmax(dim=-1).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            self._draw(logits, params, generators, rows, out)
        return Sampled(out, self._logprobs(logits, params, out))

    def _draw(self, logits: torch.Tensor, params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator], rows: list[int], out: list[int]) -> None:
        idx = torch.tensor(rows)
        sub = logits[idx]
        temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype)
        sub = sub / temps[:, None]
        if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
            top_k = torch.tensor([params[i].top_k for i in rows])
            top_p = torch.tensor([params[i].top_p for i in rows], dtype=sub.dtype)
            sub = sub.masked_fill(top_k_top_p_mask(sub, top_k, top_p), float("-inf"))
        probs = sub.softmax(dim=-1)
        if any(params[i].min_p > 0 for i in rows):
            min_p = torch.tensor([params[i].min_p for i in rows], dtype=sub.dtype)
            probs = probs.masked_fill(min_p_mask(probs, min_p), 0.0)
        for j, i in enumerate(rows):
            out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], out: list[int]
                  ) -> list[RowLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
        result: list[RowLogprobs | None] = [None] * len(params)
        if not rows:
            return result
        temps = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype)
        lp = log_probs(logits[torch.tensor(rows)], temps)  # (R, V)
        for j, i in enumerate(rows):
            result[i] = row_logprobs(lp[j], out[i], params[i].logprobs)
        return result
