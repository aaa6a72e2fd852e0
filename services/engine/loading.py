"""Load the model an engine config names (blocking: run it in the worker thread)."""

from __future__ import annotations

from typing import Any

import torch

from shared.config import ConfigError

from .config import EngineConfig
from .model import load_model
from .process_memory import drop_library_pages

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          # weights in int8 / int4 (model/quant/), activations and KV in float32
          "q8_0": torch.float32, "q4": torch.float32}


def load_for(config: EngineConfig) -> Any:
    """Load the configured model (blocking); a clear ConfigError when none is configured."""
    if not config.model_path:
        raise ConfigError(
            "engine.model_path: no model given; pass --model-path DIR with a Hugging Face model "
            "folder, or make a demo one with `overture demo-model PATH` and pass that PATH"
        )
    loaded = load_model(
        config.model_path,
        dtype=DTYPES[config.dtype],
        device=config.device,
        served_name=config.served_model_name,
        quant=config.dtype if config.dtype in ("q8_0", "q4") else "",
    )
    # The libraries' start-up pages (torch's operator registrations, the load's code) are
    # not needed to serve: they leave RSS, and what serving runs is mapped back as it runs.
    drop_library_pages()
    return loaded
