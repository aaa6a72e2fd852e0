from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.model.linear import Linear, float32_linear, pack_float32


@pytest.mark.parametrize("rows", [1, 3, 50, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_matches_the_reference_gemm(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    out = float32_linear(x, w, b)
    assert out.shape == (rows, 160) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_half_precision_linear_upcasts_from_the_threshold_and_keeps_its_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g).bfloat16()
    lin = Linear(w, None)
    few = torch.randn(2, 32, generator=g).bfloat16()
    many = torch.randn(8, 32, generator=g).bfloat16()
    assert lin(few, upcast_rows=3).dtype == torch.bfloat16 and lin.float32_bytes == 0
    out = lin(many, upcast_rows=3)
    assert out.dtype == torch.bfloat16 and lin.float32_bytes == 64 * 32 * 4
    ref = F.linear(many.float(), w.float()).bfloat16()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


def _packable() -> bool:
    return pack_float32(torch.zeros(4, 4)) is not None


@pytest.mark.parametrize("rows", [1, 3, 50, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_linear_matches_the_plain_one(rows: int, bias: bool) -> None:
    assert _packable(), "the pinned torch build packs float32 weights with oneDNN"
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    lin = Linear(w, b)
    assert lin.pack() and lin.w is None  # the plain weight is dropped
    assert lin.pack()  # packing again is a no-op
    assert torch.equal(lin.weight, w)
    torch.testing.assert_close(lin(x, upcast_rows=0), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_only_float32_cpu_weights_are_packed() -> None:
    assert pack_float32(torch.zeros(8, 4, dtype=torch.bfloat16)) is None
    assert pack_float32(torch.zeros(8)) is None
    lin = Linear(torch.zeros(8, 4, dtype=torch.bfloat16), None)
    assert not lin.pack() and lin.w is not None


def test_half_precision_upcast_copy_is_packed_and_counted() -> None:
    assert _packable(), "the pinned torch build packs float32 weights with oneDNN"
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g).bfloat16()
    lin = Linear(w, None)
    x = torch.randn(8, 32, generator=g).bfloat16()
    out = lin(x, upcast_rows=3)
    w32, _ = lin.float32_weights()
    assert w32.is_mkldnn and lin.float32_bytes == 64 * 32 * 4
    torch.testing.assert_close(out, F.linear(x.float(), w.float()).bfloat16(), rtol=1e-2, atol=1e-2)
