"""A linear layer over int8 weights with one scale per output row, computed by PyTorch's
CPU int8 weight-only GEMM (``aten._weight_int8pack_mm``).

GGUF's Q8_0 has a scale per 32 columns and Q6_K one per 16; the kernel takes one per
output row. Such weights are re-rounded onto a per-row grid (``stored.quantize_int8``): each
weight moves by at most half the row's step, ``max|w| / 254``; docs/configuration.md gives
the bound on outputs. bench/README.md ("Quantized weights") measures the exact ways of
keeping per-group scales (an int8 GEMM per group; dequantizing on every call) against it.
"""

from __future__ import annotations

import torch

from .ggml_blocks import Int8Groups
from .stored import requantize_int8


class Int8Linear:
    """x (rows, in) @ w^T + b with ``w`` as int8 (1 B a weight) and a scale per output row."""

    __slots__ = ("b", "codes", "exact", "scale")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None,
                 act_dtype: torch.dtype = torch.float32, exact: bool = True) -> None:
        self.codes = codes.contiguous()  # (out, in) int8
        self.scale = scale.to(act_dtype).contiguous()  # (out,)
        self.b = None if b is None else b.to(act_dtype)
        self.exact = exact  # False when the source's per-group scales were re-rounded

    @classmethod
    def from_groups(cls, q: Int8Groups, b: torch.Tensor | None,
                    act_dtype: torch.dtype = torch.float32) -> Int8Linear:
        """From per-group codes: kept as they are where every group of a row has the same
        scale, re-rounded per row otherwise."""
        if bool((q.scale == q.scale[:, :1]).all()):
            return cls(q.codes, q.scale[:, 0], b, act_dtype)
        per_row = requantize_int8(q)
        return cls(per_row.codes, per_row.scale[:, 0], b, act_dtype, exact=False)

    @property
    def weight_bytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * self.scale.element_size()

    def __call__(self, x: torch.Tensor, upcast_rows: int = 0) -> torch.Tensor:
        """x (rows, in) -> (rows, out) in x's dtype."""
        kx = x.to(self.scale.dtype)  # the kernel's dtype (see build.kernel_dtype)
        y = torch.ops.aten._weight_int8pack_mm(kx, self.codes, self.scale)
        return (y if self.b is None else y + self.b).to(x.dtype)
