"""The evaluation runner's parts without a cluster: each variant's config is one the
services accept, the jobs cover policies, ablations and sweeps, load imbalance is max over
median, and the report computes the goals from the records and draws its figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from bench.eval.jobs import jobs_of, trace_of
from bench.eval.measure import imbalance, tagged
from bench.eval.profiles import ABLATIONS, POLICIES, QUICK
from bench.eval.report import goals, write_report
from bench.workloads.replay import Result
from services.engine.config import EngineConfig
from services.scheduler.config import SchedulerConfig
from shared.config import build


def test_every_variant_s_config_is_accepted_by_the_services() -> None:
    seen = set()
    for v in (*POLICIES, *ABLATIONS):
        tree = yaml.safe_load(v.config(48 << 20))
        engine = build(EngineConfig, tree["engine"])
        scheduler = build(SchedulerConfig, tree["scheduler"])
        assert engine.device_memory_bytes == 48 << 20
        seen.add((scheduler.policy, engine.offload.mode, engine.offload.cooperative,
                  engine.offload.purge_order))
    assert len(seen) == 7  # every variant differs from every other
    prefix = yaml.safe_load(next(v for v in POLICIES if v.name == "prefix").config(48 << 20))
    # 48 MiB of the small model's KV: 2048 tokens, about 97 of the router's blocks
    assert build(SchedulerConfig, prefix["scheduler"]).prefix_index_blocks == 97
    assert ("balanced", "whole_prefix", True, "layers") in seen
    assert ("balanced", "layerwise", False, "layers") in seen
    assert ("balanced", "layerwise", True, "sessions") in seen


def test_jobs_cover_the_policies_the_ablations_and_both_sweeps() -> None:
    jobs = jobs_of(QUICK)
    assert {j.variant.name for j in jobs} == {v.name for v in QUICK.variants}
    assert sorted(j.missed for j in jobs if j.missed) == list(QUICK.missed)
    assert sorted(j.spurious for j in jobs if j.spurious) == list(QUICK.spurious)
    assert len({j.tag for j in jobs}) == len(jobs)
    # The same seed gives every variant the same sessions.
    a, b = (trace_of(QUICK, j, 1) for j in jobs[:2])
    assert [t.user_tokens for s in a.sessions for t in s.turns] == [
        t.user_tokens for s in b.sessions for t in s.turns]
    assert all(s.session_id.startswith("x-") for s in tagged(a, "x").sessions)


def test_imbalance_is_max_over_median_of_time_averaged_load() -> None:
    even = [(0.0, {"n0": 2, "n1": 2}), (1.0, {"n0": 1, "n1": 1})]
    assert imbalance(even) == 1.0
    skewed = [(0.0, {"n0": 6, "n1": 1, "n2": 2}), (1.0, {"n0": 6, "n1": 1, "n2": 2})]
    assert imbalance(skewed) == 3.0
    assert imbalance([]) == 1.0


def _record(variant: str, latency: float, users: int = 10, missed: float = 0.0,
            spurious: float = 0.0, load: float = 1.0, rep: int = 0) -> dict:
    req = Result("s", 0, True, 0, 0.0, latency, latency * 10, 10, 0, "node0")
    return {"rep": rep, "variant": variant, "label": variant, "users": users,
            "missed": missed, "spurious": spurious, "wall_s": 1.0,
            "summary": {"requests": 1.0, "errors": 0.0, "ttft_mean_s": latency,
                        "ttft_p95_s": latency, "tpot_mean_s": latency,
                        "normalized_latency_s": latency, "requests_per_s": 1.0,
                        "cached_tokens_mean": 0.0},
            "imbalance": load, "turns_by_source": {"device": 1.0}, "prefetch_bytes": {},
            "advisories": 1, "requests": [dataclasses.asdict(req)],
            "load": [(0.0, {"node0": 1, "node1": 1})]}


def _three(variant: str, latency: float, drift: tuple[float, ...] = (1.0, 1.1, 0.9),
           jitter: tuple[float, ...] = (1.0, 1.0, 1.0), **kw: float) -> list[dict]:
    """Three repetitions of one configuration: the machine's drift (shared by every
    variant of the same repetition) times the variant's own jitter."""
    return [_record(variant, latency * d * j, rep=i, **kw)  # type: ignore[arg-type]
            for i, (d, j) in enumerate(zip(drift, jitter, strict=True))]


def test_the_report_judges_each_goal_on_paired_intervals(tmp_path: Path) -> None:
    records = [*_three("balanced", 0.010, load=1.1), *_three("recompute", 0.030),
               *_three("sticky", 0.012, load=2.8),
               *_three("prefix", 0.016, jitter=(1.0, 1.3, 0.8)),
               *_three("balanced", 0.0105, missed=0.1),
               *_three("balanced", 0.011, missed=1.0, jitter=(1.0, 1.01, 0.99)),
               *_three("balanced", 0.0109, spurious=0.6, jitter=(1.0, 1.02, 0.98)),
               *[r for v in ABLATIONS for r in _three(v.name, 0.02)]]
    lines = "\n".join(goals(QUICK, records))
    # The drift cancels in each pair: the ratios are exact, intervals of width 0.
    assert "| 3.00× [3.00, 3.00] | met |" in lines  # vs recompute
    assert "| 1.20× [1.20, 1.20] | **missed** |" in lines  # vs sticky
    # prefix: ratios 1.6, 2.08, 1.28 -> mean 1.653, s 0.4027, half 4.303 * 0.4027 / sqrt 3
    assert "| 1.65× [0.65, 2.65] | inside the noise |" in lines
    assert "Overture 1.10 [1.10, 1.10], sticky 2.80 [2.80, 2.80] | met" in lines
    assert "| 5.0% [5.0, 5.0] | met |" in lines  # 10% missed
    assert "**missed**" in lines.splitlines()[-1]  # 60% spurious: 9% slower
    report = write_report(tmp_path / "run", QUICK, records)
    text = report.read_text()
    assert "## Ablations" in text and "| 100% | 3 |" in text
    # 100% missed: 1.1x with a spread of 1%: a difference; the 0% row is the base
    assert "| 0% | 3 | 10.0 [" in text
    for fig in ("fig11_policies", "fig15_load", "fig17_ablations", "fig19_missed",
                "fig20_spurious"):
        png = tmp_path / "run" / f"{fig}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", fig


def test_a_difference_inside_the_noise_is_reported_as_none(tmp_path: Path) -> None:
    # 10% missed: 4% slower on average but one repetition 4% faster: no difference
    records = [*_three("balanced", 0.010),
               *_three("balanced", 0.010, missed=0.1, jitter=(1.08, 0.96, 1.08))]
    text = "\n".join(goals(QUICK, records))
    assert "no difference from 0% (inside the noise)" in text
    write_report(tmp_path / "r", QUICK, records)
    assert "| 10% | 3 |" in (tmp_path / "r" / "report.md").read_text()
    assert "no difference |" in (tmp_path / "r" / "report.md").read_text()


def test_variants_interleave_and_rotate() -> None:
    from bench.eval.run import interleaved
    a, b, c = POLICIES[:3]
    order = interleaved((a, b, c), 3)
    assert order == [(0, a), (0, b), (0, c), (1, b), (1, c), (1, a), (2, c), (2, a), (2, b)]
