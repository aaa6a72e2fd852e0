"""A linear layer over 4-bit weights with an affine map per group of 32 columns, computed
by PyTorch's CPU int4 weight-only GEMM (``aten._weight_int4pack_mm_for_cpu``).

The kernel's weight is packed once (``_convert_weight_to_int4pack_for_cpu``) and its
dequantization is ``w = (q - 8) * scale + zero`` per (group, output row): GGUF's Q4_0
(``d * (q - 8)``), Q4_1 (``d * q + m``) and Q4_K's sub-blocks (``d*sc * q - dmin*m``) all
are ``q * scale + min``, i.e. ``zero = min + 8 * scale``, so no weight is re-rounded (only the
float32 sum ``min + 8 * scale`` is). The kernel computes in the dtype of its scales:
bfloat16 where the CPU has native bf16 (build.kernel_dtype; measured 1.9x float32 ``F.linear``
at one row, where float32 activations take the kernel's slow path, 7x slower), else
float32; inputs are converted to it and outputs back.
"""

from __future__ import annotations

import torch

from .ggml_blocks import Int4Groups

# The kernel's ``innerKTiles`` (2, 4 or 8): 8 packs 8 x 16 columns per tile; columns must
# be a multiple of 16 * inner_k_tiles.
_TILES = (8, 4, 2)
_PACK_ROWS = 2048  # rows packed per call at load (see Int4Linear.__init__)


def int4_supported(cols: int, group: int) -> bool:
    """Whether the CPU int4 kernel takes a weight with ``cols`` columns in groups of
    ``group`` (it wants groups of 32..256 and whole tiles of 32 columns)."""
    return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and group in (32, 64, 128, 256)
            and cols % group == 0 and cols % 32 == 0)


class Int4Linear:
    """x (rows, in) @ w^T + b with ``w`` held as packed int4 (0.5 B a weight) plus a
    (scale, zero) pair per group and output row."""

    __slots__ = ("b", "cols", "group", "packed", "rows", "scales_zeros")

    def __init__(self, q: Int4Groups, b: torch.Tensor | None,
                 act_dtype: torch.dtype = torch.float32) -> None:
        self.rows, self.cols = (int(n) for n in q.codes.shape)
        self.group = q.group
        if not int4_supported(self.cols, self.group):
            raise ValueError(f"int4 kernel: {self.cols} columns in groups of {self.group}")
        tiles = next(t for t in _TILES if self.cols % (16 * t) == 0)
        # Packed a slice of rows at a time (the layout is per row: the same bytes as one
        # call), so the kernel's int32 input, 8x the packed size, never exists whole: for a
        # tied 49152-row head that would be a 113 MB peak at load for a 14 MB weight.
        self.packed = torch.cat([
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                rows.to(torch.int32).contiguous(), tiles)
            for rows in q.codes.split(_PACK_ROWS)])
        zero = q.min + 8.0 * q.scale
        # (groups, out, 2): the kernel's layout, scale then zero
        self.scales_zeros = torch.stack((q.scale, zero), dim=-1).transpose(0, 1).contiguous() \
            .to(act_dtype)
        self.b = None if b is None else b.to(act_dtype)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))

    def __call__(self, x: torch.Tensor, upcast_rows: int = 0) -> torch.Tensor:
        """x (rows, in) -> (rows, out) in x's dtype."""
        kx = x.to(self.scales_zeros.dtype)  # the kernel's dtype (see build.kernel_dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(kx, self.packed, self.group,
                                                       self.scales_zeros)
        return (y if self.b is None else y + self.b).to(x.dtype)
