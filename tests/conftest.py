"""Every test runs inside the cluster harness's secret (``bench/harness/secret.py``), and
the tests that start real services share one tiny demo model (float32, written once per
session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness import use_cluster_secret

use_cluster_secret()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.engine.model import write_demo_model

    path = tmp_path_factory.mktemp("models") / "demo-tiny"
    write_demo_model(path, size="tiny", seed=0)
    return path
