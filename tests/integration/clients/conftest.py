"""A one-node cluster with the tiny demo model for the client SDK's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, start_cluster


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.engine.model import write_demo_model

    path = tmp_path_factory.mktemp("models") / "demo-tiny"
    write_demo_model(path, size="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("sdk"), tiny_model) as c:
        yield c
