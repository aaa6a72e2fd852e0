"""Linear layers with a CPU-aware compute dtype.

On CPUs without native bf16/fp16 matrix instructions (AVX2-only, like the reference
machine) a half-precision GEMM with many rows runs several times slower than converting
both operands to float32 first; with few rows (decode) the GEMM is memory-bound and
reading half-precision weights wins. ``upcast_rows`` is the row count from which a
half-precision linear is computed in float32 (the result is rounded back to the model
dtype, so callers never see the difference beyond rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Measured on a 2-core AVX2 EPYC: fp32 overtakes bf16 between 32 and 128 rows.
UPCAST_ROWS_NO_NATIVE_HALF = 64


def default_upcast_rows(dtype: torch.dtype, device: torch.device) -> int:
    """0 = never upcast (float32 models, GPUs, CPUs with native bf16 GEMMs)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    return UPCAST_ROWS_NO_NATIVE_HALF


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           upcast_rows: int) -> torch.Tensor:
    """x (rows, in) @ w (out, in)^T + b."""
    if upcast_rows and x.shape[0] >= upcast_rows:
        out = F.linear(x.float(), w.float(), None if b is None else b.float())
        return out.to(x.dtype)
    return F.linear(x, w, b)
