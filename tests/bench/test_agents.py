"""Smoke run of the agent bench (``bench.agents``): a cluster per variant, the tiny demo
model, one job of a few quick tool calls through the OpenAI Agents SDK."""

from __future__ import annotations

import re

import pytest

from bench.agents import tool_loop


@pytest.mark.slow
def test_tool_loop_variants(capsys: pytest.CaptureFixture[str]) -> None:
    tool_loop.main(["--size", "tiny", "--jobs", "1", "--calls", "2,2", "--latency",
                    "0.05,0.1", "--reps", "1", "--variants", "unadvised,inferred"])
    out = capsys.readouterr().out
    assert "job time vs unadvised (95% CI)" in out
    for variant in ("unadvised", "inferred"):
        assert re.search(rf"^{variant} +1 +[\d.]+ +[\d.]+/[\d.]+ +[\d.]+ ", out, re.M), out
