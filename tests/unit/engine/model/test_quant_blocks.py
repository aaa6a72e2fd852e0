"""GGUF block layouts decoded to codes and group scales, against the ``gguf`` package's own
dequantization (``gguf.quants``, llama.cpp's Python reference), and the int4/int8 kernels
against a float32 matmul over the reference weights, on random blocks of every kept type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from services.engine.model.quant import (
    BLOCK,
    FOUR_BIT,
    NAMES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    Int4Linear,
    Int8Linear,
    decode_int4,
    decode_int8,
    from_tensors,
    make_linear,
    quantize_int4,
    quantize_int8,
    requantize_int8,
    to_tensors,
)

# Where each type's fp16 fields sit in its block (the rest is codes and sub-scales).
HALVES = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q6_K: (208,)}


def random_blocks(kind: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes) of random blocks with sane fp16 scales (random bytes may be NaN)."""
    per, size = BLOCK[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        d = (rng.random(raw.shape[0]) * 0.02 + 1e-3).astype(np.float16)
        if kind == Q4_1 and at == 2:
            d = (-d * 8).astype(np.float16)  # Q4_1's min is typically negative
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // per * size)


def reference(raw: np.ndarray, kind: int, rows: int, cols: int) -> torch.Tensor:
    w = dequantize(raw, GGMLQuantizationType(kind))
    return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(rows, cols)


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0, Q4_K, Q6_K], ids=NAMES.get)
def test_each_type_decodes_to_the_reference_weights(kind: int) -> None:
    rows, cols = 8, 512
    raw = random_blocks(kind, rows, cols)
    decode = decode_int4 if kind in FOUR_BIT else decode_int8
    q = decode(torch.from_numpy(raw), kind, rows, cols)
    ref = reference(raw, kind, rows, cols)
    torch.testing.assert_close(q.dequantize(), ref, rtol=1e-6, atol=1e-6)
    # stored and read back: the same codes and scales
    back = from_tensors({k[len("w"):]: v for k, v in to_tensors("w", q).items()})
    assert torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q4_K], ids=NAMES.get)
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int4_matmul_equals_float_over_the_reference_weights(kind: int, rows: int) -> None:
    n, k = 96, 768
    raw = random_blocks(kind, n, k, seed=rows)
    lin = Int4Linear(decode_int4(torch.from_numpy(raw), kind, n, k), None)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, reference(raw, kind, n, k))
    # exact weights: only the float32 sums' order (and zero = min + 8*scale) differ
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("kind", [Q8_0, Q6_K], ids=NAMES.get)
def test_int8_matmul_is_within_the_documented_tolerance(kind: int) -> None:
    """Per-group scales re-rounded per row: each weight moves by at most half the row's
    step (max|w| / 254), so |y - y_ref| <= sum|x| * step / 2 per output."""
    n, k = 96, 768
    raw = random_blocks(kind, n, k, seed=3)
    lin = Int8Linear.from_groups(decode_int8(torch.from_numpy(raw), kind, n, k), None)
    assert not lin.exact
    w = reference(raw, kind, n, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1))
    step = w.abs().amax(dim=1) / 127
    bound = x.abs().sum(dim=1, keepdim=True) * step / 2 + 1e-4
    assert ((lin(x) - F.linear(x, w)).abs() <= bound).all()


def test_int8_codes_with_one_scale_a_row_stay_exact() -> None:
    w = torch.randn(64, 256)
    q = quantize_int8(w)
    lin = Int8Linear.from_groups(q, None)
    x = torch.randn(3, 256)
    assert lin.exact
    torch.testing.assert_close(lin(x), F.linear(x, q.dequantize()), rtol=1e-4, atol=1e-4)


def test_fused_parts_of_mixed_kinds_equal_their_parts() -> None:
    """q/k in Q4_K and v in Q6_K (as a Q4_K_M file has them) make one linear whose output
    is the parts' outputs side by side; same-kind parts fuse into one kernel."""
    k = 512
    parts = [decode_int4(torch.from_numpy(random_blocks(Q4_K, 64, k, 1)), Q4_K, 64, k),
             decode_int4(torch.from_numpy(random_blocks(Q4_K, 32, k, 2)), Q4_K, 32, k),
             decode_int8(torch.from_numpy(random_blocks(Q6_K, 32, k, 3)), Q6_K, 32, k)]
    bias = torch.randn(128)
    x = torch.randn(2, k)
    mixed = make_linear(parts, bias, torch.float32)
    alone = torch.cat([make_linear([p], None, torch.float32)(x) for p in parts], dim=1) + bias
    torch.testing.assert_close(mixed(x), alone)
    same = make_linear(parts[:2], None, torch.float32)
    assert isinstance(same, Int4Linear)
    torch.testing.assert_close(same(x), alone[:, :96] - bias[:96], rtol=1e-5, atol=1e-5)


def test_float_weights_quantize_within_half_a_step() -> None:
    w = torch.randn(16, 128)
    q = quantize_int4(w)
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=NAMES.get)
def test_re_rounding_a_slice_of_rows_at_a_time_gives_the_whole_weights_bits(kind: int) -> None:
    """The load re-rounds a wide weight (a tied head) per slice of rows so that its float
    copy never exists whole: the codes and scales are those of re-rounding it at once."""
    rows, cols = 4100, 64  # more than two slices, the last one short
    raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=5))
    q = (decode_int4 if kind in FOUR_BIT else decode_int8)(raw, kind, rows, cols)
    sliced, whole = requantize_int8(q), quantize_int8(q.dequantize())
    assert torch.equal(sliced.codes, whole.codes) and torch.equal(sliced.scale, whole.scale)
