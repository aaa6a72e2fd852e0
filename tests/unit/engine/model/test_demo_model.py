"""The demo model folder loads in our loader and in transformers, with the same logits."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.model import load_model
from services.engine.model.demo_model import SIZES

from .paged import PagedCache


def test_demo_tiny_is_small_and_complete(demo_tiny: Path) -> None:
    names = {p.name for p in demo_tiny.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    size = sum(p.stat().st_size for p in demo_tiny.iterdir())
    assert size < 8 << 20
    loaded = load_model(demo_tiny, dtype=torch.float32)
    assert loaded.config.max_position_embeddings >= 2048
    assert loaded.tokenizer.vocab_size == loaded.config.vocab_size


def test_demo_tiny_matches_transformers(demo_tiny: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    ours = load_model(demo_tiny, dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(demo_tiny, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(demo_tiny)
    text = "Why did the quiet river help in Lisbon?"
    prompt = ours.tokenizer.encode_prompt(text)
    assert prompt == hf_tok(text).input_ids
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1]
    got = PagedCache(ours.model, 1, len(prompt)).step([prompt], [0])[0]
    assert (got - want).abs().max().item() < 1e-4
    # Not degenerate: random init gives a spread of logits, not a constant.
    assert got.std().item() > 0.05


def test_demo_sizes_declared() -> None:
    tiny, small = SIZES["tiny"], SIZES["small"]
    assert small.max_pos == 8192 and tiny.max_pos >= 2048
    hd = small.hidden // small.heads
    per_layer = (small.hidden * hd * (small.heads + 2 * small.kv_heads)
                 + small.hidden * small.hidden + 3 * small.hidden * small.intermediate)
    params = small.layers * per_layer + 2 * small.vocab * small.hidden
    assert 80e6 < params < 130e6


def test_demo_is_deterministic(tmp_path: Path, demo_tiny: Path) -> None:
    from services.engine.model import write_demo_model

    again = write_demo_model(tmp_path / "again", size="tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (demo_tiny / name).read_bytes()
