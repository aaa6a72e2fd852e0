from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bench.harness import start_s3_server
from services.engine.model import LoadedModel, load_model, write_demo_model


@pytest.fixture(scope="package")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_demo_model(tmp_path_factory.mktemp("model") / "tiny", size="tiny", seed=0)
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="package")
def s3_endpoint() -> Iterator[str]:
    url, stop = start_s3_server()
    try:
        yield url
    finally:
        stop()
