"""Token sampling: greedy, temperature, top-k, top-p, with one torch.Generator per request.

Every row is processed on its own numbers (row-wise ops only) and draws from its own
generator, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .api_types import SamplingParams


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


class Sampler:
    """``sample(logits, params, generators)`` -> one token id per row."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[int]:
        """logits (S, V) float32; ``masks[i]`` (V,) bool, when not None: the tokens row
        ``i`` may take. Only masked rows are touched (a copy), so the other rows sample
        exactly what they would in a batch without constraints."""
        if masks is not None and any(m is not None for m in masks):
            logits = logits.clone()
            for i, m in enumerate(masks):
                if m is not None and bool(m.any()):
                    logits[i].masked_fill_(~m, float("-inf"))
        out = logits.argmax(dim=-1).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        idx = torch.tensor(rows)
        sub = logits[idx]
        temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype)
        sub = sub / temps[:, None]
        if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows):
            top_k = torch.tensor([params[i].top_k for i in rows])
            top_p = torch.tensor([params[i].top_p for i in rows], dtype=sub.dtype)
            sub = sub.masked_fill(top_k_top_p_mask(sub, top_k, top_p), float("-inf"))
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(rows):
            out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
        return out
