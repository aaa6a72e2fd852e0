"""Quantized linears for a model: the stored (or load-time quantized) weights of one
projection, or of several fused ones (q/k/v, gate/up), made into one kernel call.

    parts (out_i, in) each ──same kind──► one Int4Linear / Int8Linear over rows cat(out_i)
                         └─mixed kinds──► SplitLinear: a call per part, outputs concatenated

Mixed kinds are common: a "Q4_K_M" file keeps some v and down projections in Q6_K.
With dtype ``q8_0`` every weight is computed in int8 (4-bit ones widened per row).
"""

from __future__ import annotations

import torch

from .ggml_blocks import Int4Groups, Int8Groups
from .int4_linear import Int4Linear, int4_supported
from .int8_dynamic import Int8DynamicLinear, dynamic_int8_supported
from .int8_linear import Int8Linear
from .stored import requantize_int8

Groups = Int4Groups | Int8Groups


def kernel_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype the int4/int8 kernels compute in for activations of ``act``: bfloat16 on
    CPUs with native bf16 (AVX-512 BF16 / AMX; detected at run time), where PyTorch's
    kernels have their fast paths (bench/README.md, "Quantized weights"), else ``act``."""
    if act == torch.float32 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return act


class SplitLinear:
    """Several quantized linears on the same input, outputs concatenated (out_1 + ...)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Int4Linear | Int8Linear]) -> None:
        self.parts = parts

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.parts)

    def __call__(self, x: torch.Tensor, upcast_rows: int = 0) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


QuantLinear = Int4Linear | Int8Linear | SplitLinear | Int8DynamicLinear


def _one(q: Groups, b: torch.Tensor | None, act: torch.dtype) -> Int4Linear | Int8Linear:
    if isinstance(q, Int4Groups) and int4_supported(q.codes.shape[1], q.group):
        return Int4Linear(q, b, act)
    if isinstance(q, Int4Groups):  # a shape the int4 kernel does not take
        q = requantize_int8(q)
    return Int8Linear.from_groups(q, b, act)


def _cat4(parts: list[Int4Groups]) -> Int4Groups:
    return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.min for p in parts]), parts[0].group)


def make_linear(parts: list[Groups], bias: torch.Tensor | None, act: torch.dtype,
                widen_to_int8: bool = False) -> QuantLinear:
    """One linear computing the row-concatenation of ``parts`` (plus ``bias``)."""
    if widen_to_int8:
        parts = [requantize_int8(p) if isinstance(p, Int4Groups) else p
                 for p in parts]
    if len(parts) == 1:
        return _one(parts[0], bias, act)
    if all(isinstance(p, Int4Groups) for p in parts) and len({p.group for p in parts}) == 1:
        return _one(_cat4([p for p in parts if isinstance(p, Int4Groups)]), bias, act)
    if all(isinstance(p, Int8Groups) for p in parts):
        ones = [Int8Linear.from_groups(p, None, act) for p in parts if isinstance(p, Int8Groups)]
        return Int8Linear(torch.cat([o.codes for o in ones]), torch.cat([o.scale for o in ones]),
                          bias, act, exact=all(o.exact for o in ones))
    sizes = [int(p.codes.shape[0]) for p in parts]
    biases = [None] * len(parts) if bias is None else list(bias.split(sizes))
    return SplitLinear([_one(p, b, act) for p, b in zip(parts, biases, strict=True)])


def make_head(parts: list[Groups], bias: torch.Tensor | None, act: torch.dtype,
              widen_to_int8: bool = False) -> QuantLinear:
    """The output head: as ``make_linear``, except that int8 weights on a CPU with int8
    dot products are computed with int8 activations (int8_dynamic.py)."""
    int8 = widen_to_int8 or all(isinstance(p, Int8Groups) for p in parts)
    if int8 and dynamic_int8_supported():
        lin = make_linear(parts, bias, torch.float32, widen_to_int8)  # float32 scales
        if isinstance(lin, Int8Linear):
            return Int8DynamicLinear(lin)
    return make_linear(parts, bias, act, widen_to_int8)
