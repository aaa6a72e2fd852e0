"""Smoke runs of the agent benches (``bench.agents``): a cluster per variant, the tiny demo
model; one job of a few quick tool calls through the OpenAI Agents SDK, and the four-agent
workflow with a short handbook, two reps."""

from __future__ import annotations

import re

import pytest

from bench.agents import tool_loop, workflow


@pytest.mark.slow
def test_tool_loop_variants(capsys: pytest.CaptureFixture[str]) -> None:
    tool_loop.main(["--size", "tiny", "--jobs", "1", "--calls", "2,2", "--latency",
                    "0.05,0.1", "--reps", "1", "--variants", "unadvised,inferred"])
    out = capsys.readouterr().out
    assert "job time vs unadvised (95% CI)" in out
    for variant in ("unadvised", "inferred"):
        assert re.search(rf"^{variant} +1 +[\d.]+ +[\d.]+/[\d.]+ +[\d.]+ ", out, re.M), out


@pytest.mark.slow
def test_workflow_variants(capsys: pytest.CaptureFixture[str]) -> None:
    workflow.main(["--size", "tiny", "--reps", "2", "--rounds", "1", "--context-tokens",
                   "256", "--max-tokens", "4", "--variants", "unadvised,client,recompute"])
    out = capsys.readouterr().out
    for variant in ("unadvised", "client", "recompute"):
        row = re.search(rf"^{variant} +([\d.]+) \[.*?(\d+)/(\d+)$", out, re.M)
        assert row, out
        assert row.group(2) == row.group(3), out  # every answer equals recompute's
    assert re.search(r"^client +pm \d+", out, re.M), out
