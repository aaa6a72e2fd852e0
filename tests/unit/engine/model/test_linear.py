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


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [False, True])
def test_small_weight_on_one_thread_uses_mkl_with_row_invariant_results(one_thread,
                                                                        bias: bool) -> None:
    """A tiny float32 weight on one intra-op thread is computed by MKL and stays plain; every
    row gets the same bits whatever number of rows shares the call (1-3 rows padded)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(192, 64, generator=g)
    b = torch.randn(192, generator=g) if bias else None
    lin = Linear(w, b)
    assert lin.choose_kernel() and not lin.pack() and lin.w is not None
    x = torch.randn(300, 64, generator=g)
    every = lin(x, upcast_rows=0)
    torch.testing.assert_close(every, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for rows in (*range(1, 21), 64, 299):
        for at in (0, 300 - rows):
            assert torch.equal(lin(x[at:at + rows], upcast_rows=0), every[at:at + rows]), rows
    # Calls of 1-3 rows share one padding buffer; an answer is not overwritten by the next.
    first = lin(x[:1], upcast_rows=0)
    lin(x[7:10], upcast_rows=0)
    assert torch.equal(first, every[:1])


def test_small_gemm_is_not_chosen_for_large_weights_or_several_threads(one_thread) -> None:
    big = Linear(torch.randn(1024, 1024), None)
    assert not big.choose_kernel() and big.pack()
    torch.set_num_threads(2)
    small = Linear(torch.randn(64, 64), None)
    assert not small.choose_kernel()
    bf16 = Linear(torch.randn(64, 64).bfloat16(), None)
    torch.set_num_threads(1)
    assert not bf16.choose_kernel()

