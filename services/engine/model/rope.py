"""Rotary position embedding with cos/sin tables computed once and grown on demand.

Layout is the Hugging Face "rotate half" one: a head vector is split into two halves
``[x1 | x2]`` and rotated as ``[x1*cos - x2*sin | x2*cos + x1*sin]``. With the sign folded
into the sin table that is ``x*cos + roll(x, half)*sin_signed``: three kernels, no cat.
"""

from __future__ import annotations

import math

import torch

from .hf_config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with "linear" or "llama3" scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling.get("factor", 1.0))
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    return _llama3(inv_freq, factor, scaling)


def _llama3(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between is interpolated smoothly between the two.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTables:
    """cos and signed sin tables of shape (positions, head_dim), in the model dtype."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, initial: int = 4096
    ) -> None:
        self.inv_freq = inv_frequencies(config).to(device)
        self.dtype = dtype
        self.device = device
        self.cos = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self._grow(min(initial, config.max_position_embeddings))

    def _grow(self, length: int) -> None:
        pos = torch.arange(length, dtype=torch.float32, device=self.device)
        freqs = torch.outer(pos, self.inv_freq)  # (length, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (length, head_dim)
        half = emb.shape[-1] // 2
        sign = torch.ones_like(emb)
        sign[:, :half] = -1.0  # first half gets -x2*sin, second half +x1*sin
        self.cos = emb.cos().to(self.dtype)
        self.sin = (emb.sin() * sign).to(self.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: (T, 1, head_dim) so they broadcast over heads."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, 1, head_dim) from RotaryTables.lookup."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
