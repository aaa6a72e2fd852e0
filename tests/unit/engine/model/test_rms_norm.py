"""The model's RMS norm: float32 in one call, with the reference's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.model.llama import rms_norm


@pytest.mark.parametrize("rows", [1, 3, 4, 77, 512])
def test_float32_rms_norm_in_one_call_equals_the_reference_bit_for_bit(rows: int) -> None:
    """float32 norms take torch.rms_norm with the weight: the same bits as normalising
    with F.rms_norm and scaling after, as the half-precision path (and transformers) do."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g) * 3
    w = torch.randn(96, generator=g)
    with torch.inference_mode():
        want = w * F.rms_norm(x, (96,), eps=1e-6)
        assert torch.equal(rms_norm(x, w, 1e-6), want)
        half = rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
        assert torch.equal(half, w.bfloat16() * F.rms_norm(x.bfloat16().float(), (96,),
                                                           eps=1e-6).bfloat16())
