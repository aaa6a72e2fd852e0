"""Smoke runs of the cluster benches (``bench.cluster``): each starts its own cluster of
real processes through the harness, on the tiny demo model."""

from __future__ import annotations

import re

import pytest

from bench.cluster import admission, advisory_ttft, hostile_clients, idle_cost, overload, resume


@pytest.mark.slow
def test_resume_by_where_the_kv_is(capsys: pytest.CaptureFixture[str]) -> None:
    # The modes whose KV is where only a kvstore or engine call puts it (the advisory
    # bench's smoke run takes the others' paths).
    resume.main(["--size", "tiny", "--history", "64", "--reps", "1", "--modes", "dram,s3",
                 "--no-warmup"])
    out = capsys.readouterr().out
    assert "history 64 + 50 new tokens, tiny model, fp32, two nodes" in out
    assert "| recompute | device | DRAM | peer | S3 |" in out
    assert re.search(r"^\| \d+ ms \| - \| \d+ ms \([\d.]+×\) \| - \| \d+ ms \([\d.]+×\) \|$",
                     out, re.M), out
    assert re.search(r"^S3 [\d.]+× recompute \(goal ≥ 8×: (met|NOT met)\)$", out, re.M), out


@pytest.mark.slow
def test_advisory_ttft_by_lead_time(capsys: pytest.CaptureFixture[str]) -> None:
    advisory_ttft.main(["--size", "tiny", "--history", "64", "--reps", "1",
                        "--leads", "0.25", "--no-warmup"])
    out = capsys.readouterr().out
    assert "| turn | TTFT | × recompute | / device |" in out
    for mode in ("recompute", "device", "peer", "s3", "device+0.25", "peer+0.25", "s3+0.25"):
        assert f"| {mode} | " in out
        assert re.search(rf"^  {re.escape(mode)} +KV from: \S", out, re.M), out
    assert "peer, advisory 0.25 s ahead:" in out and "s3, advisory 0.25 s ahead:" in out


@pytest.mark.slow
def test_overload_goodput(capsys: pytest.CaptureFixture[str], sigterm_handler: None) -> None:
    # The overload phase, one short load level. (The decode phase starts two more
    # `overture up` clusters: `--phases decode --decode-cores shared --decode-streams 2
    # --decode-tokens 4` is its smallest run, left out here for time.)
    overload.main(["--size", "tiny", "--phases", "overload", "--warmup", "0.5",
                   "--capacity-clients", "2", "--capacity-duration", "1", "--loads", "1",
                   "--duration", "1", "--pause", "0", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "two nodes, tiny model (fp32), divided cores" in out
    assert re.search(r"^capacity [\d.]+ req/s \(2 clients", out, re.M), out
    assert "| load | offered req/s | sent | goodput req/s | vs 1× |" in out
    assert re.search(r"^\| 1× \| [\d.]+ \| \d+ \| [\d.]+ \| [\d.]+× \|", out, re.M), out
    assert re.search(r"^  no 503 and no timeout at any load: (met|NOT met)$", out, re.M), out


@pytest.mark.slow
def test_admission_queue_wait(capsys: pytest.CaptureFixture[str], sigterm_handler: None) -> None:
    admission.main(["--size", "tiny", "--warmup", "0.5", "--capacity-clients", "2",
                    "--capacity-duration", "1", "--loads", "1,10", "--reps", "1",
                    "--duration", "1", "--pause", "0", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "two nodes, tiny model (fp32), divided cores" in out
    assert "engine.max_queue_delay_s 0.5 s" in out
    assert "| load | admitted p50 wait | admitted p99 wait | p99 / limit |" in out
    assert re.search(r"^\| 1× \| \d+ ms \[\d+–\d+\] \| \d+ ms .* \| 1\.00× \[", out, re.M), out
    assert re.search(r"^\| 10× \| ", out, re.M), out
    assert re.search(r"^  admitted p99 wait at 10× ≤ 2 × 0.5 s: (met|NOT met)$", out, re.M), out
    # Where the admitted requests' wait went, by stage (the scheduler's histograms), and
    # every refusal a 429 with Retry-After, nothing else.
    # (and the share of the 429s the scheduler's admission windows gave)
    assert "| load | scheduler | to_engine | engine | back | client | 429s at the scheduler |" \
        in out
    assert re.search(r"^\| 1× \| (\d+ ms \[\d+–\d+\]|-)( \| (\d+ ms \[\d+–\d+\]|-)){4} "
                     r"\| (\d+%|-) \|$", out, re.M), out
    assert "other outcomes (503, timeouts, errors): 0; 429s without Retry-After: 0" in out


def test_hostile_clients_with_and_without_deadlines(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    hostile_clients.main(["--connections", "20", "--uploads", "4", "--deadline-s", "0.5"])
    out = capsys.readouterr().out
    assert "20 slow-header clients, 4 stalled 4 MiB uploads" in out
    assert "open headers" in out and "RSS stalled" in out
    assert re.search(r"^deadlines +\d+ +\d+ +-?\d+MB +-?\d+MB$", out, re.M), out
    assert re.search(r"^none \(baseline\) +\d+ +\d+ +-?\d+MB +-?\d+MB$", out, re.M), out


@pytest.mark.slow
def test_idle_cost_by_service(capsys: pytest.CaptureFixture[str]) -> None:
    idle_cost.main(["--systems", "swap", "--seconds", "1", "--settle-s", "0"])
    out = capsys.readouterr().out
    line = re.search(r"^swap: [\d.]+ CPU-s in 1 s idle \([\d.]+% of the cores; (.*)\)$", out,
                     re.M)
    assert line, out
    services = dict(re.findall(r"(\w+) x(\d+) [\d.]+", line.group(1)))
    assert services == {"engine": "2", "kvstore": "2", "nodemgr": "2", "scheduler": "1"}
