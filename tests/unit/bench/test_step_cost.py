"""bench.engine.step_cost runs both linear paths on one model and checks they agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.engine import step_cost
from services.engine.model import write_demo_model


def test_measure_times_both_paths_with_equal_tokens(tmp_path: Path) -> None:
    path = write_demo_model(tmp_path / "tiny", size="tiny", seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mkl, onednn = step_cost.measure(path, batch=2, rounds=2, steps=3)
    except step_cost.MklNotChosen as e:
        pytest.skip(str(e))
    finally:
        torch.set_num_threads(before)
    assert mkl > 0 and onednn > 0
