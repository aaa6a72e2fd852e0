"""How quantized weights sit in a served folder's safetensors, and quantizing float ones.

A linear weight ``W`` (out, in) is stored either as ``W`` (float, as Hugging Face writes
it) or, once prepared from a GGUF file (services/models/gguf_weights.py), as

    W.q4codes  uint8 (out, in/2)   two 4-bit codes a byte: column 2j low nibble, 2j+1 high
    W.q4scale  float32 (out, in/g) per group of g columns
    W.q4min    float32 (out, in/g)        w = code * scale + min
or
    W.q8codes  int8 (out, in)
    W.q8scale  float32 (out, in/g)        w = code * scale

so a file is about the size of its GGUF and loading never makes a float copy of a weight.
A float weight served with ``dtype`` ``q4`` or ``q8_0`` is quantized here at load
(round to nearest: 4-bit affine per 32 columns, or 8-bit symmetric per row).
"""

from __future__ import annotations

import torch

from .ggml_blocks import Int4Groups, Int8Groups

Q4_SUFFIXES = (".q4codes", ".q4scale", ".q4min")
Q8_SUFFIXES = (".q8codes", ".q8scale")
QUANT_DTYPES = ("q4", "q8_0")  # engine dtypes whose weights are int4 / int8
Q4_GROUP = 32


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes 0..15 -> (rows, cols/2) bytes, even column in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def to_tensors(name: str, q: Int4Groups | Int8Groups) -> dict[str, torch.Tensor]:
    """The stored tensors of weight ``name``."""
    if isinstance(q, Int4Groups):
        return {name + ".q4codes": pack_nibbles(q.codes), name + ".q4scale": q.scale.float(),
                name + ".q4min": q.min.float()}
    return {name + ".q8codes": q.codes, name + ".q8scale": q.scale.float()}


def from_tensors(get: dict[str, torch.Tensor]) -> Int4Groups | Int8Groups:
    """A weight from its stored tensors (keys are the suffixes above)."""
    if ".q4codes" in get:
        codes = unpack_nibbles(get[".q4codes"])
        scale = get[".q4scale"].float()
        return Int4Groups(codes, scale, get[".q4min"].float(), codes.shape[1] // scale.shape[1])
    codes, scale = get[".q8codes"], get[".q8scale"].float()
    return Int8Groups(codes, scale, codes.shape[1] // scale.shape[1])


def quantize_int4(w: torch.Tensor, group: int = Q4_GROUP) -> Int4Groups:
    """A float (rows, cols) weight as 4-bit codes, affine per ``group`` columns (min/max
    round to nearest, as GGUF's Q4_1)."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = (hi - lo) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Groups(codes.reshape(rows, cols), scale, lo, group)


def quantize_int8(w: torch.Tensor) -> Int8Groups:
    """A float (rows, cols) weight as int8 codes with one scale per row (a single group)."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127.0
    codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return Int8Groups(codes, scale, w.shape[1])


_REROUND_ROWS = 2048  # rows dequantized at a time by ``requantize_int8``


def requantize_int8(q: Int4Groups | Int8Groups) -> Int8Groups:
    """Grouped codes re-rounded onto one int8 scale per row: ``quantize_int8`` of their
    dequantized weights, a slice of rows at a time (the same bits: every step is per row),
    so the float copy never exists whole. For SmolLM2's tied 49,152-row Q8_0 head that
    copy and its temporaries were a ~400 MB peak at load for a 28 MB weight."""
    rows = q.codes.shape[0]
    parts = []
    for at in range(0, rows, _REROUND_ROWS):
        end = min(at + _REROUND_ROWS, rows)
        piece = (Int4Groups(q.codes[at:end], q.scale[at:end], q.min[at:end], q.group)
                 if isinstance(q, Int4Groups) else
                 Int8Groups(q.codes[at:end], q.scale[at:end], q.group))
        parts.append(quantize_int8(piece.dequantize()))
    return Int8Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      q.codes.shape[1])
