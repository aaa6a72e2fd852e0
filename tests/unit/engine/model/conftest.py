"""Fixtures: the tiny demo model and random tiny transformers checkpoints saved to tmp dirs."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.engine.model import write_demo_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def demo_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=0)


def base_config(**overrides: object) -> dict:
    cfg = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
               "bos_token_id": 0, "eos_token_id": 4}
    cfg.update(overrides)
    return cfg


@pytest.fixture
def hf_checkpoint(tmp_path: Path, demo_tiny: Path) -> Callable[..., tuple[Path, object]]:
    """Build a random transformers model from a config, save it with safetensors next to the
    demo tokenizer, and return (folder, model in fp32 eval mode)."""

    def make(arch: str = "llama", seed: int = 0, **overrides: object) -> tuple[Path, object]:
        import transformers as tf

        cls_cfg, cls_model = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        }[arch]
        torch.manual_seed(seed)
        config = cls_cfg(**base_config(**overrides))
        model = cls_model(config).eval()
        with torch.no_grad():  # norms start at 1.0: perturb so they matter in the parity
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        folder = tmp_path / f"{arch}-{seed}"
        model.save_pretrained(folder, safe_serialization=True)
        for f in TOKENIZER_FILES:
            shutil.copy(demo_tiny / f, folder / f)
        return folder, model

    return make
