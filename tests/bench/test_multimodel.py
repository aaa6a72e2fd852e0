"""Smoke runs of the multi-model benches (``bench.multimodel``)."""

from __future__ import annotations

import re

import pytest

from bench.multimodel import (
    activation,
    cold_start,
    load,
    model_loading,
    remap,
    remap_node,
    search,
)


@pytest.mark.slow
def test_load_attainment(capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # (the bench sets it: restored)
    # prism alone on two of the models (two engines a node): the other systems are
    # cluster settings of the same code (bench.cluster.idle_cost starts swap's).
    load.main(["--systems", "prism", "--models", "2", "--loads", "2", "--phases", "1",
               "--phase-s", "1", "--prompt-words", "20", "--gen", "4"])
    out = capsys.readouterr().out
    assert re.search(r"^  prism  load  2.0/s: attainment +[\d.]+%, +[\d.]+ req/s "
                     r"\(\d+/\d+ done; met by model: tiny-1 \d+/\d+, tiny-2 \d+/\d+\)$",
                     out, re.M), out
    assert "| load (req/s) | prism attainment | prism req/s |" in out
    assert re.search(r"^\| 2 \| [\d.]+% \| [\d.]+ \|$", out, re.M), out
    assert "goals: not judged" in out


@pytest.mark.slow
def test_search_with_the_reuse_store(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    # Two models, one engine a node (so they take turns: cold starts), one load, two
    # repetitions of one short phase.
    search.main(["--models", "2", "--pool", "1", "--start", "2", "--max-load", "2",
                 "--reps", "2", "--phases", "1", "--phase-s", "2", "--prompt-words", "20",
                 "--gen", "4"])
    out = capsys.readouterr().out
    assert re.search(r"^load chosen: 2/s \(baseline pool: 2/s [\d.]+%\)$", out, re.M), out
    assert "| system | attainment (mean [95% CI]) |" in out
    for system in ("pool", "pool-store"):
        assert re.search(rf"^\| {system} \| [\d.]+% \[", out, re.M), out
    assert re.search(r"^pool-store vs pool: attainment (no difference|lower|higher)", out,
                     re.M), out


def test_activation_against_a_new_process(capsys: pytest.CaptureFixture[str]) -> None:
    activation.main(["--size", "tiny", "--dtype", "float32", "--reps", "1"])
    out = capsys.readouterr().out
    assert "tiny model (float32), 1 reps, median seconds to the first token" in out
    assert re.search(r"new engine process +[\d.]+ s", out), out
    for source in ("disk", "host memory"):
        assert re.search(rf"activate, from {source} +[\d.]+ s +\([\d.]+x faster than a new "
                         "process\\)", out), out
    assert "goal: activation from host memory < 1 s:" in out


def test_model_loading_through_the_reuse_store(capsys: pytest.CaptureFixture[str]) -> None:
    model_loading.main(["--size", "tiny", "--reps", "2"])
    out = capsys.readouterr().out
    assert "| activation | seconds (mean [95% CI]) | vs plain from host memory |" in out
    for variant in ("disk", "host", "store 0%", "store 50%", "store 100%"):
        assert re.search(rf"^\| {variant} \| [\d.]+ \[", out, re.M), out
    assert re.search(r"memory, four models: \d+ MiB of tensors in the arena", out), out
    assert "goals: 50% resident >= 2x:" in out


def test_remap_under_a_burst(capsys: pytest.CaptureFixture[str]) -> None:
    remap.main(["--reps", "1", "--bursts", "1", "--burst", "3", "--prompt-words", "120",
                "--gen", "2"])
    out = capsys.readouterr().out
    assert "| variant | p99 TTFT s | p99 TBT s | tok/s | max α |" in out
    for v in ("off", "single", "double", "dynamic"):
        assert re.search(rf"^\| {v} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+ \| 0 \|", out,
                         re.M), out
    assert re.search(r"^\| dynamic \| .* \| [1-9]\d* \| 0 \|", out, re.M), out  # it lent
    assert "no KV pressure" in out and "max α 0" in out
    assert "tokens equal to off's in every variant: yes" in out


def test_remap_across_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    remap_node.main(["--reps", "1", "--bursts", "1", "--burst", "3", "--prompt-words", "120",
                     "--gen", "2"])
    out = capsys.readouterr().out
    assert "| variant | p99 TTFT s | p99 TBT s | tok/s | own α max | node layers max |" in out
    for v in ("off", "own", "node"):
        assert re.search(rf"^\| {v} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+ \| \d+ \| 0 \|", out,
                         re.M), out
    # (whether the smoke's short burst outlasts a broker round depends on the machine's
    # speed: the lending itself is tested in tests/integration/multimodel/test_node_lending)
    assert "layers left lent to the node after the trace: 0" in out
    assert "busy model's tokens equal to off's in every variant: yes" in out


def test_cold_start_parts_with_and_without_the_store(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # (the bench sets it: restored)
    cold_start.main(["--size", "tiny", "--reps", "2", "--requests", "1", "--batch", "2",
                     "--prompt-words", "20", "--gen", "4"])
    out = capsys.readouterr().out
    assert ("| part (ms) | private | store 0% | store 100% | private / store 0% | "
            "private / store 100% |") in out
    for part in ("activation", "TTFT #1", "TPOT #1", "TPOT, batch of 2", "cold-start TTFT"):
        assert re.search(rf"^\| {part} \| [\d.]+ \[", out, re.M), out
    assert "tokens equal to private's in every variant: yes" in out
