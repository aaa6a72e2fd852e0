"""Quantized weights kept quantized (DESIGN §5): GGUF blocks decoded to int4/int8 codes and
group scales, computed by PyTorch's CPU weight-only int4/int8 GEMMs."""

from __future__ import annotations

from .build import Groups, QuantLinear, SplitLinear, kernel_dtype, make_head, make_linear
from .embedding import QuantEmbedding
from .ggml_blocks import (
    BLOCK,
    EIGHT_BIT,
    FOUR_BIT,
    NAMES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    Int4Groups,
    Int8Groups,
    decode_int4,
    decode_int8,
)
from .int4_linear import Int4Linear
from .int8_dynamic import Int8DynamicLinear, dynamic_int8_supported
from .int8_linear import Int8Linear
from .stored import (
    Q4_SUFFIXES,
    Q8_SUFFIXES,
    QUANT_DTYPES,
    from_tensors,
    quantize_int4,
    quantize_int8,
    requantize_int8,
    to_tensors,
)

__all__ = [
    "BLOCK",
    "EIGHT_BIT",
    "FOUR_BIT",
    "NAMES",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q4_SUFFIXES",
    "Q6_K",
    "Q8_0",
    "Q8_SUFFIXES",
    "QUANT_DTYPES",
    "Groups",
    "Int4Groups",
    "Int4Linear",
    "Int8DynamicLinear",
    "Int8Groups",
    "Int8Linear",
    "QuantEmbedding",
    "QuantLinear",
    "SplitLinear",
    "decode_int4",
    "decode_int8",
    "dynamic_int8_supported",
    "from_tensors",
    "kernel_dtype",
    "make_head",
    "make_linear",
    "quantize_int4",
    "quantize_int8",
    "requantize_int8",
    "to_tensors",
]
