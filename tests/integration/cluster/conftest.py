"""Shared fixtures: one tiny demo model per test session (float32, written into tmp)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.engine.model import write_demo_model

    path = tmp_path_factory.mktemp("models") / "demo-tiny"
    write_demo_model(path, size="tiny", seed=0)
    return path
