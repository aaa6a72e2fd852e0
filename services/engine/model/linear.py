"""Linear layers with a CPU-aware compute dtype.

On CPUs without native bf16/fp16 matrix instructions (AVX2-only, like the reference
machine) a half-precision GEMM costs about the same per row as a one-row (memory-bound)
GEMM, so its time grows linearly with the rows, while a float32 GEMM with a few rows
costs little more than one. A one-row step reads half the bytes in half precision and
wins there; from ``upcast_rows`` rows on, a half-precision linear is computed in float32
instead, against a float32 copy of the weights made once (converting the weights per call
would cost as much as the GEMM). The result is rounded back to the model dtype, so
callers never see the difference beyond rounding. The copy costs twice the half-precision
weight bytes, in host memory, for as long as the model lives.

Float32 GEMMs on CPU go through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the op
PyTorch's own CPU compiler emits for linears) rather than ``F.linear`` (MKL): with the
few rows of a decode step or a short prompt suffix it was 1.3-1.8x faster here (12 layers
of the demo "small" model, 50 rows: 85 vs 117 ms; 1 row: 17 vs 24 ms), and even at 512
rows. Where the op is missing (a build without oneDNN) ``F.linear`` is used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Measured on a 2-core AVX2 EPYC with float32 weight copies, demo "small" shapes: bf16
# and float32 are even at 2 rows, float32 wins from 3 rows on (at 32 rows 3-5x: gate_up
# 4096x768 11.2 ms bf16 vs 2.4 ms float32); at 1 row bf16 reads half the bytes.
UPCAST_ROWS_NO_NATIVE_HALF = 3


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return None

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return op(x, w, b, "none", [], "")

    return linear


_ONEDNN_LINEAR = _onednn_linear()


def float32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) @ w^T + b, all float32: oneDNN on CPU when available."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu":
        return _ONEDNN_LINEAR(x, w, b)
    return F.linear(x, w, b)


def default_upcast_rows(dtype: torch.dtype, device: torch.device) -> int:
    """0 = never upcast (float32 models, GPUs, CPUs with native bf16 GEMMs)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    return UPCAST_ROWS_NO_NATIVE_HALF


class Linear:
    """A weight (out, in) and an optional bias (out,), shared with the owning module's
    parameters, plus their float32 copies made on the first call with enough rows."""

    __slots__ = ("w", "b", "_w32", "_b32")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.w = w
        self.b = b
        self._w32: torch.Tensor | None = None
        self._b32: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, upcast_rows: int) -> torch.Tensor:
        """x (rows, in) @ w^T + b -> (rows, out) in x's dtype."""
        if self.w.dtype == torch.float32:
            return float32_linear(x, self.w, self.b)
        if upcast_rows and x.shape[0] >= upcast_rows:
            w32, b32 = self.float32_weights()
            return float32_linear(x.float(), w32, b32).to(x.dtype)
        return F.linear(x, self.w, self.b)

    def float32_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._w32 is None:
            with torch.no_grad():
                self._w32 = self.w.detach().float().contiguous()
                self._b32 = None if self.b is None else self.b.detach().float()
        return self._w32, self._b32

    def release_float32(self) -> None:
        self._w32 = self._b32 = None

    @property
    def float32_bytes(self) -> int:
        """Host bytes held by the float32 copies (0 until the first upcast call)."""
        return sum(t.numel() * t.element_size() for t in (self._w32, self._b32) if t is not None)
