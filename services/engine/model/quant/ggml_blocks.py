"""GGUF (ggml) quantized blocks decoded into integer codes and per-group scales.

Nothing here dequantizes to float: a row of blocks becomes the codes the int4/int8 kernels
take and the scale (and offset) of each group of weights, so that ``w = code * scale + min``
(4-bit) or ``w = code * scale`` (8-bit) reproduces ggml's own dequantization
(``ggml-quants.c``: ``dequantize_row_*``) up to float32 rounding of one product.

Block layouts, from ggml's ``ggml-common.h`` (all little-endian, ``half`` is IEEE fp16):

    Q4_0  18 B / 32 w   half d; u8 qs[16]         w[j] = d*(lo(qs[j]) - 8), w[j+16] = hi nibble
    Q4_1  20 B / 32 w   half d, m; u8 qs[16]      w = d*q + m, nibbles as Q4_0
    Q8_0  34 B / 32 w   half d; i8 qs[32]         w = d*q
    Q4_K 144 B / 256 w  half d, dmin; u8 scales[12] (8 x 6-bit scale, 6-bit min); u8 qs[128]
                        sub-block s of 32: w = d*sc[s]*q - dmin*m[s]; 64 weights per 32 bytes
                        of qs: the low nibbles are sub-block 2i, the high ones 2i+1
    Q6_K 210 B / 256 w  u8 ql[128] (low 4 bits), u8 qh[64] (high 2 bits), i8 scales[16]; half d
                        16 groups of 16: w = d*scales[g]*(q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml's type ids (enum ggml_type) for the types kept quantized.
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
# (weights per block, bytes per block)
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
FOUR_BIT = (Q4_0, Q4_1, Q4_K)
EIGHT_BIT = (Q8_0, Q6_K)


@dataclass(frozen=True)
class Int4Groups:
    """A (rows, cols) weight as 4-bit codes with an affine map per group of ``group``
    columns: ``w[r, c] = codes[r, c] * scale[r, c // group] + min[r, c // group]``."""

    codes: torch.Tensor  # (rows, cols) uint8 in 0..15
    scale: torch.Tensor  # (rows, cols // group) float32
    min: torch.Tensor  # (rows, cols // group) float32
    group: int

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        g = self.codes.view(rows, cols // self.group, self.group).float()
        return (g * self.scale[..., None] + self.min[..., None]).view(rows, cols)


@dataclass(frozen=True)
class Int8Groups:
    """A (rows, cols) weight as signed codes with a scale per group of ``group`` columns:
    ``w[r, c] = codes[r, c] * scale[r, c // group]``."""

    codes: torch.Tensor  # (rows, cols) int8
    scale: torch.Tensor  # (rows, cols // group) float32
    group: int

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        g = self.codes.view(rows, cols // self.group, self.group).float()
        return (g * self.scale[..., None]).view(rows, cols)


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block of ``raw`` (blocks, bytes), as float32."""
    return raw[:, at:at + 2].contiguous().view(torch.float16).float().squeeze(-1)


def _blocks(raw: torch.Tensor, kind: int, cols: int) -> torch.Tensor:
    """(rows, bytes) of one tensor -> (rows * blocks_per_row, block bytes)."""
    per, size = BLOCK[kind]
    if cols % per:
        raise ValueError(f"{NAMES[kind]}: {cols} columns are not whole blocks of {per}")
    rows = raw.numel() // (cols // per * size)
    if raw.numel() != rows * (cols // per) * size:
        raise ValueError(f"{NAMES[kind]}: {raw.numel()} bytes are not whole rows of {cols}")
    return raw.reshape(rows * (cols // per), size)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(blocks, 16) bytes -> (blocks, 32) codes: low nibbles first, then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def decode_int4(raw: torch.Tensor, kind: int, rows: int, cols: int) -> Int4Groups:
    """A Q4_0, Q4_1 or Q4_K tensor (raw bytes) as 4-bit codes with per-32 scale and min."""
    b = _blocks(raw.view(torch.uint8), kind, cols)
    if kind in (Q4_0, Q4_1):
        d = _half(b, 0)
        head = 2 if kind == Q4_0 else 4
        codes = _nibbles(b[:, head:head + 16])  # (blocks, 32)
        low = -8.0 * d if kind == Q4_0 else _half(b, 2)
        return Int4Groups(codes.reshape(rows, cols), d.reshape(rows, cols // 32),
                          low.reshape(rows, cols // 32), 32)
    if kind != Q4_K:
        raise ValueError(f"type {NAMES.get(kind, kind)} is not a 4-bit type")
    d, dmin = _half(b, 0), _half(b, 2)
    sc, mn = _k4_scales(b[:, 4:16])  # (blocks, 8) each
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 32 bytes = 64 weights each
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 256)  # sub-blocks in order
    scale = d[:, None] * sc.float()
    low = -(dmin[:, None] * mn.float())
    return Int4Groups(codes.reshape(rows, cols), scale.reshape(rows, cols // 32),
                      low.reshape(rows, cols // 32), 32)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes -> eight 6-bit scales and eight 6-bit mins (ggml's
    ``get_scale_min_k4``): sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); sub-blocks 4-7 take 4 bits from bytes 8-11 and their top 2 from the top bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    s = s.to(torch.int32)
    sc_lo, mn_lo = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc_hi = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn_hi = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((sc_lo, sc_hi), dim=1), torch.cat((mn_lo, mn_hi), dim=1)


def decode_int8(raw: torch.Tensor, kind: int, rows: int, cols: int) -> Int8Groups:
    """A Q8_0 (groups of 32) or Q6_K (groups of 16) tensor as signed codes and scales."""
    b = _blocks(raw.view(torch.uint8), kind, cols)
    if kind == Q8_0:
        d = _half(b, 0)
        codes = b[:, 2:34].contiguous().view(torch.int8)
        return Int8Groups(codes.reshape(rows, cols), d.reshape(rows, cols // 32), 32)
    if kind != Q6_K:
        raise ValueError(f"type {NAMES.get(kind, kind)} is not an 8-bit type")
    ql = b[:, 0:128].reshape(-1, 2, 2, 32).to(torch.int32)  # (blocks, half, lo/hi 32, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)  # (blocks, half, 1, 32)
    # Per half of 128: [ql[0:32] lo, ql[32:64] lo, ql[0:32] hi, ql[32:64] hi], each with two
    # bits of qh[0:32] at shifts 0, 2, 4, 6.
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # (blocks, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    codes = ((low | (high << 4)) - 32).to(torch.int8).reshape(-1, 256)
    d = _half(b, 208)
    scale = d[:, None] * b[:, 192:208].contiguous().view(torch.int8).float()  # (blocks, 16)
    return Int8Groups(codes.reshape(rows, cols), scale.reshape(rows, cols // 16), 16)
