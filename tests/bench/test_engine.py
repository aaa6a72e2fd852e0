"""Smoke runs of the engine benches (``bench.engine``): one engine in this process (or in
one spawned process per side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engine import decode_mixed, kernel_pairs, peer, quant_kernels, speed, step_cost


@pytest.mark.slow
def test_speed_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    speed.main(["--size", "tiny", "--quick", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "prefill tok/s ours" in out and "decode tok/s ours" in out
    for batch in speed.BATCHES:
        assert f"\n{batch:>5} | " in out
    assert "peak RSS: ours" in out and "memory: weights " in out and "peak RSS / that" in out
    assert "goal batch-1 decode >= 1.0x transformers" in out
    assert "goal decode at 32 concurrent >= 4x ours at 1" in out
    assert "with a json_schema; goal constrained costs <= 10%" in out
    assert "with top_logprobs 5 + penalties + logit_bias vs plain: cost " in out
    assert "batch-1 decode, all-decode fast path vs general path: " in out
    assert "(mean ratio, 95% interval, 2 interleaved pairs)" in out
    assert "weights read at batch-1 decode: " in out and "GB/s this host copies at" in out


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


def test_quant_kernels_against_float32(capsys: pytest.CaptureFixture[str],
                                       torch_threads: None) -> None:
    quant_kernels.main(["--quick", "--rows", "1", "--repeat", "1"])
    out = capsys.readouterr().out
    for variant in ("f32:", "int4-g32:", "int8-row:", "int8-g32-loop:", "int8-g32-deq:"):
        assert f"qkv   960x576   rows   1 {variant:>15}" in out, out
    assert "x f32" in out and "MiB read" in out


@pytest.mark.slow
def test_speed_quantized_with_the_peer_missing(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """q4 on a float demo folder (quantized at load); no llama.cpp: said, the rest runs."""
    monkeypatch.delenv(peer.ENV, raising=False)
    speed.main(["--size", "tiny", "--quick", "--dtype", "q4", "--peer", "llama.cpp"])
    out = capsys.readouterr().out
    assert "decode tok/s ours" in out and "transformers: not run (q4 weights" in out
    assert "llama.cpp: not run: no llama.cpp: pass --llama-cpp-bin DIR" in out


def test_kernel_pairs_q4_against_q8_0(capsys: pytest.CaptureFixture[str]) -> None:
    kernel_pairs.main(["--pairs", "2", "--prompt-len", "8", "--gen", "4"])
    out = capsys.readouterr().out
    assert "batch-1 decode, prompt 8, 4 tokens, 2 interleaved pairs" in out
    assert "q4 / q8_0 tok/s: " in out and "q8_0 / q4 CPU a token: " in out
    assert "(mean ratio, 95% interval)" in out
    assert "greedy tokens: " in out


def test_llama_batched_bench_table_parses() -> None:
    text = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     32 |    1 |    160 |    0.210 |   609.52 |    0.301 |   106.31 |    0.511 |   313.11 |
|   128 |     32 |   32 |   5120 |    7.000 |   585.14 |    3.100 |   330.32 |   10.100 |   506.93 |
"""
    assert peer.parse_batched(text) == {1: 106.31, 32: 330.32}


def test_peer_runs_again_without_repacking_after_an_illegal_instruction(tmp_path: Path) -> None:
    """A llama.cpp built for the host dies of SIGILL where AMX is not granted: the bench
    runs the tool again with repacking off and says so, instead of failing."""
    rows = ('[{"n_prompt": 16, "n_gen": 0, "avg_ts": 50.0}, '
            '{"n_prompt": 0, "n_gen": 4, "avg_ts": 9.5}]')
    tool = tmp_path / "llama-bench"
    tool.write_text(f"#!/bin/sh\ncase \"$*\" in *'--repack 0'*) echo '{rows}';; "
                    "*) kill -ILL $$;; esac\n")
    tool.chmod(0o755)
    notes: list[str] = []
    assert peer.llama_bench(tmp_path, tmp_path / "m.gguf", 2, [16], 4, notes) == ({16: 50.0}, 9.5)
    assert notes == ["llama-bench: illegal instruction with weight repacking (AMX not granted "
                     "here?); run with --repack 0"]
