"""Fixtures of the engine offload tests."""

from __future__ import annotations

import pytest
import torch

from services.engine.model import LoadedModel, load_model, write_demo_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_demo_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)
    return load_model(path, dtype=torch.float32)
