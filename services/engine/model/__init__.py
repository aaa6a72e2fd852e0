"""The engine's model: Llama-family decoder over a paged per-layer KV pool, its loader,
tokenizer and a random-weight demo model (DESIGN §5)."""

from __future__ import annotations

from .demo_model import write_demo_model
from .errors import LoaderError
from .hf_config import ModelConfig
from .llama import LlamaModel
from .loader import LoadedModel, load_model
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "LlamaModel",
    "LoadedModel",
    "LoaderError",
    "ModelConfig",
    "Tokenizer",
    "load_model",
    "write_demo_model",
]
