"""Smoke runs of the simulator's scripts (``bench.sim``): its calibration on the bare
engine and through a cluster, the scaling experiments, and the map of where each policy
wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness import REPO
from bench.sim import calibrate, calibrate_cluster, margin, scale
from bench.sim import map as sim_map
from bench.sim.costs import Calibration


def test_calibrate_on_the_bare_engine(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      torch_threads: None) -> None:
    calibrate.main(["--size", "tiny", "--dtype", "float32", "--out", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert "prefill new=  16 ctx=    0:" in out and "decode batch=  1 ctx=   64:" in out
    assert f"wrote {tmp_path / 'c.json'}" in out
    cal = Calibration.load(tmp_path / "c.json")
    assert cal.name == "cpu-tiny" and cal.num_layers == 2


@pytest.mark.slow
def test_calibrate_through_a_cluster(capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    calibrate_cluster.main([
        "--size", "tiny", "--quick", "--out", str(tmp_path / "c.json"),
        "--base", str(REPO / "bench" / "sim" / "calibration-cpu-small.json")])
    out = capsys.readouterr().out
    assert "first tokens (prompt tokens, s):" in out
    assert "decode steps (streams per node, s):" in out
    assert f"wrote {tmp_path / 'c.json'}: prefill " in out
    assert Calibration.load(tmp_path / "c.json").name == "cpu-small-cluster"


def test_scale_simulations(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    scale.main(["--nodes", "2", "--users", "4", "--max-answer", "16", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| nodes | users | policy | TPOT ms | TTFT ms |" in out
    for policy in scale.POLICIES:
        assert f"| 2 | 4 | {policy} | " in out
    assert (tmp_path / "scale.md").read_text() in out + "\n"
    assert (tmp_path / "fig11-tpot.png").stat().st_size > 0
    assert (tmp_path / "fig15-load.png").stat().st_size > 0


@pytest.mark.slow
def test_the_map_picks_its_axes_and_points(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    sim_map.main(["--quick", "--seeds", "2", "--workloads", "sharegpt", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "## sharegpt: each axis alone" in out
    assert "## sharegpt: the two most telling axes" in out
    assert "| sharegpt, largest balanced vs sticky |" in out
    assert "python -m bench.eval.run --profile load --variants recompute sticky prefix" in out
    assert (tmp_path / "map.md").read_text() in out + "\n"
    assert (tmp_path / "map-sharegpt.png").stat().st_size > 0


def test_the_locality_margin_beside_sticky(capsys: pytest.CaptureFixture[str]) -> None:
    margin.main(["--workload", "sharegpt", "--sessions", "1", "--seeds", "2",
                 "--move-tokens", "0", "64", "--max-user", "32"])
    out = capsys.readouterr().out
    assert "| variant | ms/token | sticky / variant |" in out
    assert "| balanced, move_tokens 0 | " in out and "| balanced, move_tokens 64 | " in out
