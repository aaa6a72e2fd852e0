"""The multi-model tests' demo models, written once for the whole directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.multimodel.reuse_models import write_models, write_unrelated


@pytest.fixture(scope="session")
def fine_tunes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``base`` and fine-tunes ``a``, ``b``, ``c`` sharing half their tensors."""
    return write_models(tmp_path_factory.mktemp("fine-tunes"))


@pytest.fixture(scope="session")
def unrelated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``alpha``, ``beta``, ``gamma``: tiny models sharing nothing."""
    return write_unrelated(tmp_path_factory.mktemp("unrelated"))
