"""The output head with int8 activations (quant/int8_dynamic.py): exact int32 sums, every
row the same bits at every row count, within the documented tolerance of the float head,
and chosen for an int8 head where the CPU has int8 dot products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.model.quant import (
    Int4Linear,
    Int8DynamicLinear,
    Int8Linear,
    dynamic_int8_supported,
    make_head,
    quantize_int4,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(not dynamic_int8_supported(),
                                reason="no oneDNN int8 linear or no VNNI/AMX on this CPU")


def _head(n: int = 640, k: int = 96, bias: bool = False) -> tuple[Int8DynamicLinear, Int8Linear]:
    g = torch.Generator().manual_seed(n + k)
    q = quantize_int8(torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g) if bias else None
    ref = Int8Linear(q.codes, q.scale[:, 0], b)
    return Int8DynamicLinear(ref), ref


def test_sums_are_exact_and_within_the_input_step_of_the_float_product() -> None:
    head, ref = _head(bias=True)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 3
    y = head(x)
    w = ref.codes.float() * ref.scale[:, None]
    step = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x / step)
    exact = (xq.double() @ ref.codes.double().T) * ref.scale.double() * step.double()
    assert ref.b is not None
    torch.testing.assert_close(y.double(), exact + ref.b.double(), rtol=1e-6, atol=1e-6)
    bound = step / 2 * w.abs().sum(dim=1) + 1e-5
    assert ((y - F.linear(x, w, ref.b)).abs() <= bound).all()


def test_a_row_gets_the_same_bits_at_every_row_count() -> None:
    """A sequence's logits do not depend on the rows beside it (each row its own scale)."""
    head, _ = _head()
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(2))
    x[7] *= 100  # an outlier row must not change the others' quantization
    whole = head(x)
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 33):
        for at in (0, 40 - m):
            assert torch.equal(head(x[at:at + m]), whole[at:at + m]), (m, at)


def test_an_int8_head_computes_with_int8_activations_a_4_bit_one_keeps_its_kernel() -> None:
    w = torch.randn(256, 64) * 0.05
    assert isinstance(make_head([quantize_int8(w)], None, torch.bfloat16), Int8DynamicLinear)
    assert isinstance(make_head([quantize_int4(w)], None, torch.float32), Int4Linear)
    widened = make_head([quantize_int4(w)], None, torch.float32, widen_to_int8=True)
    assert isinstance(widened, Int8DynamicLinear)
