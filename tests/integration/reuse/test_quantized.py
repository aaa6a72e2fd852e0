"""The 6-turn conversation of test_conversation.py with the model's weights in int4
(quantized at load, ``dtype`` q4): reused KV from the device, DRAM, SSD and S3 still gives
exactly the tokens recomputation gives with the same quantized weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine.model import LoadedModel, load_model, write_demo_model
from services.engine.model.quant import Int4Linear
from tests.integration.reuse.harness import reference_transcript
from tests.integration.reuse.test_conversation import (
    test_history_from_device,
    test_history_from_dram,
    test_history_from_s3,
    test_history_from_ssd,
)

__all__ = ["test_history_from_device", "test_history_from_dram", "test_history_from_s3",
           "test_history_from_ssd"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_demo_model(tmp_path_factory.mktemp("model") / "tiny", size="tiny", seed=0)
    model = load_model(path, dtype=torch.float32, quant="q4")
    assert isinstance(model.model.decoder_layers[0].qkv, Int4Linear)
    return model


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel):
    return asyncio.run(reference_transcript(loaded))
