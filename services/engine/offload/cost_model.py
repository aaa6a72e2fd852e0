"""Load or recompute: which stored spans of a prompt's prefix are worth loading.

A lookup finds the prompt's blocks ``[device, matched)`` stored in the kvstore as spans, each
in a tier with a measured bandwidth. Loading the first ``k`` spans (covering ``T_k``
tokens, ``B_k`` bytes) leaves ``N - T_k`` tokens to compute:

    tokens:  | on device | span 0 | span 1 | span 2 |  ... rest of the prompt ... |
             0           D                          matched                        N
    load_k    = overhead + sum(bytes_i / bandwidth(tier_i))       over spans i < k
    compute_k = (N - T_k) * seconds_per_token
    layerwise:    ttft_k ~ max(load_k, compute_k) + min(load_k, compute_k) / num_layers
    whole_prefix: ttft_k = load_k + compute_k

and the plan keeps the ``k`` (0 = recompute everything) with the smallest estimate, the
longest on a tie. ``k = 0`` is always a candidate, so a slow tier never makes the estimate
worse than recomputing (SGLang #26305: a disk hit losing to recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv_layout import KVSpan

LAYERWISE, WHOLE_PREFIX, RECOMPUTE = "layerwise", "whole_prefix", "recompute"


@dataclass(frozen=True)
class Estimate:
    spans: int  # how many leading spans to load
    seconds: float  # estimated time to first token
    recompute_seconds: float  # the estimate with nothing loaded


def choose_spans(
    spans: list[KVSpan],
    *,
    prompt_tokens: int,
    device_tokens: int,
    block_size: int,
    tier_bytes_per_s: dict[str, float],
    seconds_per_token: float,
    num_layers: int,
    mode: str,
    overhead_s: float = 0.0,
) -> Estimate:
    """How many leading ``spans`` to load (see the module docstring)."""
    if mode == RECOMPUTE or not spans:
        rest = (prompt_tokens - device_tokens) * seconds_per_token
        return Estimate(0, rest, rest)

    def ttft(load: float, compute: float) -> float:
        if mode == WHOLE_PREFIX:
            return load + compute
        return max(load, compute) + min(load, compute) / num_layers

    recompute = (prompt_tokens - device_tokens) * seconds_per_token
    best = Estimate(0, recompute, recompute)
    load = overhead_s
    for k, s in enumerate(spans, start=1):
        bw = tier_bytes_per_s.get(s.tier, 0.0)
        if bw <= 0:
            break  # no measured bandwidth for this tier: never bet on it
        load += s.nbytes / bw
        covered = min(s.end_block * block_size, prompt_tokens)
        t = ttft(load, (prompt_tokens - covered) * seconds_per_token)
        if t <= best.seconds:
            best = Estimate(k, t, recompute)
    return best


class PrefillRate:
    """EWMA of the engine's own prefill cost in seconds per token (steps with enough
    tokens to be prefill-dominated); starts from a configured prior."""

    def __init__(self, prior_s_per_token: float, alpha: float = 0.3, min_tokens: int = 32) -> None:
        self.value = prior_s_per_token
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < self.min_tokens or seconds <= 0:
            return
        rate = seconds / tokens
        a = self.alpha
        self.value = rate if self.samples == 0 else (1 - a) * self.value + a * rate
        self.samples += 1
