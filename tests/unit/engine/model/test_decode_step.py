"""The all-decode fast path (decode_step.py) gives the general path's logits and cache
bits exactly, and is taken only where it applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.model import load_model
from services.engine.model.decode_step import DecodeStep

from .paged import PagedCache


def _run(model, fast: bool, prompts: list[list[int]], steps: int,
         offsets: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill each prompt (general path), then ``steps`` greedy decode steps of every
    sequence at once with the fast path on or off: every step's logits, the final cache.
    ``offsets[s]``: tokens sequence ``s`` leaves out of its prompt (its context length)."""
    n = len(prompts)
    cache = PagedCache(model, n, max(len(p) for p in prompts) + steps + 1, block_size=4)
    model.fast_decode = False
    cached = [0] * n
    last = []
    for s, p in enumerate(prompts):
        toks = p[:len(p) - offsets[s]]
        step = [[] for _ in range(n)]
        step[s] = toks
        last.append(int(cache.step(step, cached)[0].argmax()))
        cached[s] = len(toks)
    model.fast_decode = fast
    out = []
    for _ in range(steps):
        logits = cache.step([[t] for t in last], cached)
        out.append(logits)
        cached = [c + 1 for c in cached]
        last = logits.argmax(dim=-1).tolist()
    return out, cache.kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offsets", [[0], [0, 0, 0], [0, 1, 3]])
def test_fast_decode_is_bit_identical(demo_tiny: Path, dtype: torch.dtype,
                                      offsets: list[int]) -> None:
    """One sequence (no mask), several of one length and of near lengths (one group with
    a padding mask): the same logits and the same cache, bit for bit, every step."""
    model = load_model(demo_tiny, dtype=dtype).model
    prompts = [[5 + s, 17, 99, 3 + s, 250, 31, 8, 77, 12, 40][: 10] for s in range(len(offsets))]
    fast, fast_kv = _run(model, True, prompts, 6, offsets)
    slow, slow_kv = _run(model, False, prompts, 6, offsets)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fast_kv, slow_kv)


def test_fast_path_taken_only_for_all_decode_steps(demo_tiny: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(demo_tiny, dtype=torch.float32).model
    calls: list[int] = []
    real = DecodeStep.attend

    def spy(self, layer, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(layer)
        return real(self, layer, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "attend", spy)
    cache = PagedCache(model, 2, 32)
    cache.step([[5, 6, 7, 8], [9, 10, 11]], [0, 0])  # prompts: general path
    assert calls == []
    cache.step([[12], [13, 14]], [4, 3])  # a decode beside a prompt chunk: general path
    assert calls == []
    cache.step([[15], [16]], [5, 5])  # every sequence decodes: fast, every layer
    assert calls == list(range(model.config.num_layers))
    model.fast_decode = False
    cache.step([[17], [18]], [6, 6])
    assert calls == list(range(model.config.num_layers))
