"""Smoke runs of the kvstore benches (``bench.kvstore``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.harness import REPO
from bench.kvstore import chunk_mac, resume_ttft


@pytest.mark.slow
def test_tiers_against_their_raw_media() -> None:
    # A process of its own: the bench tunes glibc malloc and torch's threads for good.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.kvstore.tiers", "--quick", "--reps", "1",
         "--budget-s", "0", "--max-chunks", "32"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    # Exit 1 is a ratio under its goal, which one pass over 32 chunks cannot judge; a
    # failure shows as a traceback, before the last line.
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    out = proc.stdout
    for tier in ("dram", "ssd", "ssd(sync)", "s3"):
        for kib in (64, 1024):
            assert any(line.startswith(f"{tier:<10} {kib:>5} KiB  put ") and " ratio " in line
                       for line in out.splitlines()), (tier, kib, out)
    assert "get_many of a layer (8 chunks, the load path)" in out
    assert "worst ratio " in out


@pytest.mark.slow
def test_resume_ttft_by_tier(capsys: pytest.CaptureFixture[str]) -> None:
    resume_ttft.main(["--demo-size", "tiny", "--quick", "--sizes", "64"])
    out = capsys.readouterr().out
    assert "resume TTFT: tiny demo model, float32" in out
    assert "history 64 tokens + 50-token message (TTFT, median)" in out
    for mode in ("recompute", "device", "dram", "dram_whole", "ssd", "ssd_whole"):
        assert f"  {mode:<11} " in out and "x vs recompute" in out
    assert "ssd: load alone" in out and "<= 1.2 x max" in out


def test_chunk_mac_cost(capsys: pytest.CaptureFixture[str]) -> None:
    chunk_mac.main(["--quick", "--reps", "1"])
    out = capsys.readouterr().out
    for name in ("xxh3-64", "hmac-sha256", "blake2b-128 keyed", "verify_chunk"):
        assert f"   64 KiB  {name:<18}" in out and f" 1024 KiB  {name:<18}" in out, out
