"""Smoke runs of the engine benches (``bench.engine``): one engine in this process (or in
one spawned process per side)."""

from __future__ import annotations

import pytest

from bench.engine import decode_mixed, speed, step_cost


@pytest.mark.slow
def test_speed_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    speed.main(["--size", "tiny", "--quick", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "prefill tok/s ours" in out and "decode tok/s ours" in out
    for batch in speed.BATCHES:
        assert f"\n{batch:>5} | " in out
    assert "peak RSS: ours" in out
    assert "goal batch-1 decode >= 1.0x transformers" in out
    assert "goal decode at 32 concurrent >= 4x ours at 1" in out
    assert "with a json_schema; goal constrained costs <= 10%" in out
    assert "with top_logprobs 5 + penalties + logit_bias vs plain: cost median" in out


def test_step_cost_mkl_against_onednn(capsys: pytest.CaptureFixture[str],
                                      torch_threads: None) -> None:
    step_cost.main(["--rounds", "1", "--steps", "2", "--batches", "1"])
    out = capsys.readouterr().out
    if "nothing to compare on this host" in out:
        pytest.skip(out.rsplit("nothing to compare on this host: ", 1)[1].strip())
    assert "| model | batch | ms/step, MKL small GEMMs | ms/step, oneDNN only | speed-up |" in out
    assert "| tiny | 1 | " in out and "| tiny-deep | 1 | " in out


def test_decode_mixed_grouped_against_padded(capsys: pytest.CaptureFixture[str]) -> None:
    decode_mixed.main(["--size", "tiny", "--long", "64", "--short", "16", "--batch", "2",
                       "--tokens", "4", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "decode, 1 x 64 + 1 x 16 tokens of context, 4 tokens each" in out
    assert "greedy tokens identical" in out
    assert "  padded " in out and "x padded" in out
