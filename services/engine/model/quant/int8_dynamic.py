"""The output head over int8 weights with int8 activations: each input row quantized with a
scale of its own, the products summed in int32 by oneDNN (``onednn::qlinear_pointwise``,
VNNI / AMX int8 instructions), the sums scaled back to float32.

Why the head: it is the widest GEMM of a decode step (SmolLM2's tied head is 49,152 x 576,
a fifth of the model's weights), and PyTorch's int8 weight-only kernel
(``_weight_int8pack_mm``), which converts every weight to float, took 4.6 ms of a core a
token there; this one 2.0 ms (bench/README.md, "Quantized weights"). On the decoder's
narrower linears the per-call cost of quantizing the input (seven small tensor
operations) ate the gain, so they keep their kernels.

Reused KV and recomputation see the same logits: a row's scale is its own (per-tensor
dynamic quantization, as ``quantized.linear_dynamic`` does, would make a row's logits
depend on the rows beside it), and int32 sums are exact in any order, so each row gets the
same bits at every row count (tests/unit/engine/model/test_int8_dynamic.py).

Tolerance: the weights are the int8 ones the weight-only kernel computes on; each input
moves by at most half its row's step ``s = max|x| / 127``, so a logit moves by at most
``s / 2 * sum_k |w_k|`` beyond float32 rounding.
"""

from __future__ import annotations

import torch

from .int8_linear import Int8Linear


def dynamic_int8_supported() -> bool:
    """oneDNN's int8 linear is here and the CPU has int8 dot-product instructions (AVX-512
    VNNI or AMX; detected at run time). Without them oneDNN emulates the int8 products,
    slower than the weight-only kernel."""
    cpu = getattr(torch, "cpu", None)
    vnni = bool(cpu is not None and getattr(cpu, "_is_vnni_supported", lambda: False)())
    amx = bool(cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return (torch.backends.mkldnn.is_available() and (vnni or amx)
            and hasattr(torch.ops.onednn, "qlinear_prepack")
            and hasattr(torch.ops.onednn, "qlinear_pointwise"))


class Int8DynamicLinear:
    """x (rows, in) @ w^T + b with ``w`` int8 (one scale per output row), held in oneDNN's
    packed layout (1 B a weight, as the plain codes)."""

    __slots__ = ("_one", "_zero", "_zeros", "b", "cols", "packed", "rows", "scale")

    def __init__(self, lin: Int8Linear) -> None:
        self.rows, self.cols = (int(n) for n in lin.codes.shape)
        self.packed = torch.ops.onednn.qlinear_prepack(lin.codes, [1, self.cols])
        self.scale = lin.scale.float().contiguous()
        self.b = None if lin.b is None else lin.b.float()
        self._one = torch.tensor(1.0)  # the input scale oneDNN applies: 1, ours come after
        self._zero = torch.tensor(0, dtype=torch.int32)
        self._zeros = torch.zeros(self.rows, dtype=torch.int32)  # symmetric weights

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.cols + self.scale.numel() * self.scale.element_size()

    def __call__(self, x: torch.Tensor, upcast_rows: int = 0) -> torch.Tensor:
        """x (rows, in) -> (rows, out) float32 (then x's dtype)."""
        xf = x.float()
        step = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(127.0)
        xq = xf.div(step).round_().to(torch.int8)
        y = torch.ops.onednn.qlinear_pointwise.tensor(
            xq, self._one, self._zero, self.packed, self.scale, self._zeros, None, 1.0, 0,
            torch.float32, "none", [], "")
        y.mul_(step)
        if self.b is not None:
            y.add_(self.b)
        return y.to(x.dtype)
