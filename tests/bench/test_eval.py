"""Smoke run of the evaluation (``bench.eval.run``): its smoke profile (Overture alone on
the tiny model, two users) on one `overture up` cluster, with the simulator beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.eval import run
from bench.harness import REPO


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:No artists with labels")  # (sticky's empty load plot)
def test_run_writes_its_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    calibration = REPO / "bench" / "sim" / "calibration-cluster-quick.json"
    run.main(["--profile", "smoke", "--results-dir", str(tmp_path), "--run", "smoke",
              "--sim", str(calibration)])
    out = capsys.readouterr().out
    report = tmp_path / "smoke" / "report.md"
    assert out.strip() == report.read_text().strip()
    assert "# Evaluation run `smoke` (smoke profile)" in out
    assert "the random-weight `tiny` model" in out
    for heading in ("## Policies (Figure 11)", "## Ablations at the highest load (Figure 17)",
                    "## Missed advisories (Figure 19)", "## Spurious advisories (Figure 20)",
                    "## Goals", "## Simulator against the measurement"):
        assert heading in out
    assert "| Overture (balanced), 2 | " in out and "| balanced, 2 users | " in out
    records = json.loads((tmp_path / "smoke" / "results.json").read_text())["records"]
    assert [(r["variant"], r["users"]) for r in records] == [("balanced", 2)]
    assert records[0]["summary"]["requests"] > 0 and records[0]["summary"]["errors"] == 0
    for fig in ("fig11_policies", "fig15_load", "fig17_ablations", "fig19_missed",
                "fig20_spurious"):
        assert (tmp_path / "smoke" / f"{fig}.png").stat().st_size > 0
