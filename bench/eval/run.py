"""Reproduce the Symphony evaluation (§4) on this machine: a local 2-node cluster started
with ``overture up`` per variant (each engine on its own core, the random-weight ``small``
model, a device budget small enough for memory pressure) replays the same ShareGPT-shaped
traces (``bench/workloads``) against the policies (recompute, sticky, balanced) and the
ablations, then sweeps missed and spurious advisories on ``balanced``. Writes
``bench/results/<run>/report.md`` with tables and plots, and ``results.json``.

    python -m bench.eval.run --quick            # under 10 minutes
    python -m bench.eval.run --profile full     # more users and sessions, longer
    python -m bench.eval.run --profile smoke --results-dir DIR   # a smoke run: a minute

With ``--sim CALIBRATION`` it also simulates the same traces (``bench/sim``) and reports
the simulated TTFT and TPOT beside the measured ones.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.eval.jobs import Job, jobs_of, trace_of
from bench.eval.measure import Measured, imbalance, measure, tagged
from bench.eval.profiles import PROFILES, Profile, Variant
from bench.eval.report import write_report
from bench.eval.sim_check import simulate_jobs
from bench.harness import overture_up, show_progress
from bench.workloads.replay import summary

RESULTS = Path(__file__).resolve().parents[1] / "results"


def record(job: Job, m: Measured, wall_s: float, rep: int = 0) -> dict[str, Any]:
    return {
        "rep": rep,
        "variant": job.variant.name, "label": job.variant.label, "users": job.users,
        "missed": job.missed, "spurious": job.spurious, "wall_s": wall_s,
        "summary": summary(m.results), "imbalance": imbalance(m.load),
        "turns_by_source": m.turns_by_source, "prefetch_bytes": m.prefetch_bytes,
        "advisories": m.advisories, "load": m.load, "tier_bytes": m.tier_bytes,
        "requests": [dataclasses.asdict(r) for r in m.results],
    }


def interleaved(variants: tuple[Variant, ...], reps: int) -> list[tuple[int, Variant]]:
    """(repetition, variant) in the order they run: every variant once per repetition,
    the order rotated each time, so that a drift of the machine's load during the run
    falls on every variant alike and no variant always runs first or last."""
    out = []
    for rep in range(reps):
        k = rep % len(variants) if variants else 0
        out += [(rep, v) for v in (*variants[k:], *variants[:k])]
    return out


def run(profile: Profile, run_dir: Path, seed: int, ready_timeout: float) -> list[dict]:
    """Each repetition replays the traces of its own seed (``seed + rep``) on every
    variant, a fresh cluster each time: repetition r of two variants is a pair."""
    jobs = jobs_of(profile)
    records: list[dict] = []
    bar = tqdm(total=len(jobs) * profile.reps, desc="replays", unit="replay",
               file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="overture-eval-") as tmp:
        for rep, variant in interleaved(profile.variants, profile.reps):
            mine = [j for j in jobs if j.variant == variant]
            config = Path(tmp) / f"{variant.name}.yaml"
            config.write_text(variant.config(profile.device_memory_bytes))
            workdir = Path(tmp) / f"{variant.name}-{rep}"
            workdir.mkdir()
            bar.set_postfix_str(f"starting {variant.name}")
            with overture_up(workdir, size=profile.model_size,
                             extra_args=["--config", str(config)],
                             ready_timeout=ready_timeout, label=variant.name) as cluster:
                if profile.warmup_users:
                    # A first replay warms the engines (allocator pages, kernels): not measured.
                    warm = tagged(trace_of(profile, Job(variant, profile.warmup_users),
                                           seed + 1000 + rep), "warm")
                    asyncio.run(measure(cluster.url, cluster.model, warm, profile.time_scale,
                                        profile.max_answer_tokens))
                for job in mine:
                    bar.set_postfix_str(job.tag)
                    trace = tagged(trace_of(profile, job, seed + rep), job.tag)
                    t0 = time.monotonic()
                    m = asyncio.run(measure(cluster.url, cluster.model, trace,
                                            profile.time_scale, profile.max_answer_tokens))
                    records.append(record(job, m, time.monotonic() - t0, rep))
                    _save(run_dir, profile, seed, records)  # (a run cut short keeps these)
                    bar.update()
                    errors = sum(1 for r in m.results if r.error)
                    if errors:
                        tqdm.write(f"{job.tag}: {errors} of {len(m.results)} requests failed "
                                   f"(first: {next(r.error for r in m.results if r.error)})",
                                   file=sys.stderr)
    bar.close()
    _save(run_dir, profile, seed, records)
    return records


def _save(run_dir: Path, profile: Profile, seed: int, records: list[dict]) -> None:
    (run_dir / "results.json").write_text(json.dumps(
        {"profile": dataclasses.asdict(profile), "seed": seed, "records": records}, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="full")
    ap.add_argument("--quick", action="store_true", help="the quick profile (< 10 min)")
    ap.add_argument("--run", default="", help="results folder name [default: date-profile]")
    ap.add_argument("--results-dir", default=str(RESULTS),
                    help="where the results folders are [bench/results]")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--users", type=int, nargs="*", default=None,
                    help="active users per load level [the profile's]")
    ap.add_argument("--workload", choices=("sharegpt", "agent"), default=None)
    ap.add_argument("--sigma", type=float, default=None, help="turn-length lognormal spread")
    ap.add_argument("--cv", type=float, default=None, help="burstiness: arrival gaps' CV")
    ap.add_argument("--device-mib", type=int, default=None,
                    help="device KV per engine, MiB (memory pressure) [the profile's]")
    ap.add_argument("--reps", type=int, default=0,
                    help="repetitions of every replay, variants interleaved [the profile's]")
    ap.add_argument("--variants", nargs="*", default=None, help="only these variants")
    ap.add_argument("--sim", default="", help="a bench/sim calibration JSON: also simulate")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the report of an earlier --run from its results.json")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    show_progress()
    profile = PROFILES["quick" if args.quick else args.profile]
    if args.reps:
        profile = dataclasses.replace(profile, reps=args.reps)
    # A point of the simulator's map (bench.sim.map prints these flags for each point).
    point = {"users": tuple(args.users) if args.users else None, "workload": args.workload,
             "sigma": args.sigma, "gap_cv": args.cv,
             "device_memory_bytes": args.device_mib << 20 if args.device_mib else None}
    profile = dataclasses.replace(profile, **{k: v for k, v in point.items() if v is not None})
    if args.variants:
        profile = dataclasses.replace(profile, variants=tuple(
            v for v in profile.variants if v.name in args.variants))
    run_dir = Path(args.results_dir) / (args.run
                                        or f"{time.strftime('%Y%m%d-%H%M')}-{profile.name}")
    if not args.report_only:
        run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.report_only:
        saved = run_dir / "results.json"
        if not saved.is_file():
            ap.error(f"--report-only: no results.json in {run_dir} (run it first)")
        records = json.loads(saved.read_text())["records"]
    else:
        records = run(profile, run_dir, args.seed, args.ready_timeout)
    sim = None
    if args.sim:
        sim = simulate_jobs(profile, args.seed, Path(args.sim), records)
    report = write_report(run_dir, profile, records, sim)
    print(report.read_text())
    print(f"[{time.monotonic() - t0:.0f} s] report: {report}", file=sys.stderr)


if __name__ == "__main__":
    main()
