"""Prism's multi-model benchmark rerun with the Reuse Store (issue 46): the load where a
baseline first drops below 99% TTFT SLO attainment, found by the bench itself, then
repeated paired replays there.

    python -m bench.multimodel.search [--systems pool,pool-store] [--reps 5] [--pool 2]
        [--start 1] [--growth 1.5] [--max-load 12] [--phase-s 8] [--phases 4] [--models 4]

A difference between systems shows only where the baseline misses some SLOs (at 2 and 4
req/s with 4 phases every system met 100%). So the load grows from ``--start`` by
``--growth`` until the baseline (the first system) replays a trace under 99%; every
system then replays ``--reps`` traces at that load, in a rotated order per repetition
(same trace and seed for all in a repetition). Reported per system with 95% intervals:
attainment, the p95 TTFT of the cold starts (requests that waited for their model's
activation: ``usage.model_activation_s``) and the median activation they waited for;
then the baseline's cold-start p95 over each other system's, paired per repetition.
Every system's cluster stays up through the run, so the store's residency carries over
from one replay to the next, as it would serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.eval.stats import Interval, compare, goal_at_least, mean_interval, paired_ratio
from bench.harness import Cluster, start_cluster
from bench.multimodel.clusters import MODELS, Shape, cluster_setup, slos, write_models
from bench.multimodel.load import Sample, replay, summarize, trace

GOAL = 1.3  # cold-start p95 TTFT, baseline over the store (issue 46)


@dataclass
class Rep:
    attainment: float
    cold: int  # cold starts (requests that waited for an activation)
    cold_p95: float  # their p95 TTFT (nan: none)
    activation_s: float  # the median activation they waited for (nan: none)


def p95(xs: Sequence[float]) -> float:
    """Nearest-rank 95th percentile (nan for no samples)."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def measure(samples: list[Sample], seconds: float, slo: dict[str, float], system: str,
            load: float) -> Rep:
    r = summarize(system, load, samples, seconds, slo)
    cold = [s for s in samples if s.activation_s > 0 and s.ttft is not None]
    waits = sorted(s.activation_s for s in cold)
    return Rep(r.attainment, len(cold), p95([s.ttft for s in cold if s.ttft is not None]),
               waits[len(waits) // 2] if waits else math.nan)


def run(systems: list[str], paths: dict[str, Path], work: Path, shape: Shape, *,
        start: float, growth: float, max_load: float, reps: int, phase_s: float,
        phases: int) -> str:
    """Search, repeat, and the report (markdown)."""
    slo = slos(paths)
    names = list(slo)
    with contextlib.ExitStack() as stack:
        clusters: dict[str, Cluster] = {}
        for system in systems:
            first, kw = cluster_setup(system, paths, work, shape)
            clusters[system] = stack.enter_context(start_cluster(work / system, first, **kw))

        def one(system: str, load: float, seed: int) -> Rep:
            reqs = trace(load, phase_s, phases, seed=seed, names=names)
            samples, seconds = asyncio.run(replay(clusters[system].url, reqs, seed, shape))
            rep = measure(samples, seconds, slo, system, load)
            print(f"  {system:10} load {load:5.2f}/s seed {seed}: attainment "
                  f"{rep.attainment:6.1%}, {rep.cold} cold starts, p95 TTFT "
                  f"{rep.cold_p95:.3f} s, median activation {rep.activation_s:.3f} s",
                  flush=True)
            return rep

        base = systems[0]
        load, tried = start, list[tuple[float, float]]()
        while True:  # the search: the baseline's first load under 99%
            att = one(base, load, seed=len(tried)).attainment
            tried.append((load, att))
            if att < 0.99 or load * growth > max_load:
                break
            load = round(load * growth, 2)
        print(f"load chosen: {load:g}/s (baseline {base}: "
              + ", ".join(f"{x:g}/s {a:.1%}" for x, a in tried) + ")", flush=True)
        got: dict[str, list[Rep]] = {s: [] for s in systems}
        for r in range(reps):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for system in order:
                got[system].append(one(system, load, seed=1000 + r))
    return report(got, base, load, tried)


def report(got: dict[str, list[Rep]], base: str, load: float,
           tried: list[tuple[float, float]]) -> str:
    below = tried[-1][1] < 0.99
    lines = [f"load {load:g} req/s: " + (f"the baseline ({base}) first under 99% there"
                                         if below else f"the baseline ({base}) held 99% up "
                                         "to the highest load tried"),
             "", "| system | attainment (mean [95% CI]) | cold starts per replay | "
             "cold-start p95 TTFT, s | median activation waited, s |",
             "| --- | --- | --- | --- | --- |"]
    for system, reps in got.items():
        p = [r.cold_p95 for r in reps if not math.isnan(r.cold_p95)]
        a = [r.activation_s for r in reps if not math.isnan(r.activation_s)]
        lines.append(f"| {system} | {_pct(mean_interval([r.attainment for r in reps]))} | "
                     f"{sum(r.cold for r in reps) / len(reps):.1f} | "
                     f"{mean_interval(p).fmt(digits=3) if p else 'none'} | "
                     f"{mean_interval(a).fmt(digits=3) if a else 'none'} |")
    b = got[base]
    for system, reps in got.items():
        if system == base:
            continue
        att = compare([r.attainment for r in reps], [r.attainment for r in b])
        pairs = [(x.cold_p95, y.cold_p95) for x, y in zip(b, reps, strict=True)
                 if not (math.isnan(x.cold_p95) or math.isnan(y.cold_p95))]
        if len(pairs) < 2:
            lines.append(f"{system} vs {base}: attainment {att}; cold-start p95: fewer than "
                         "two repetitions with cold starts in both, no ratio")
            continue
        ratio = paired_ratio([x for x, _ in pairs], [y for _, y in pairs])
        lines.append(f"{system} vs {base}: attainment {att} ({system} against {base}); "
                     f"cold-start p95 TTFT {base}/{system} {ratio.fmt(digits=2, unit='x')}; "
                     f"goal >= {GOAL}x at equal attainment: {goal_at_least(ratio, GOAL)}"
                     + ("" if att == "no difference" else " (attainment differs)"))
    return "\n".join(lines)


def _pct(i: Interval) -> str:
    return i.fmt(scale=100, digits=1, unit="%")


def main(argv: list[str] | None = None) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # (several engines a node: see load.main)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="pool,pool-store", help="the first is the baseline")
    ap.add_argument("--reps", type=int, default=5, help="replays per system at the load")
    ap.add_argument("--start", type=float, default=1.0, help="first load (req/s)")
    ap.add_argument("--growth", type=float, default=1.5, help="load factor a search step")
    ap.add_argument("--max-load", type=float, default=12.0, help="highest load searched")
    ap.add_argument("--phase-s", type=float, default=8.0, help="seconds a model stays hot")
    ap.add_argument("--phases", type=int, default=4, help="each model is hot phases/4 times")
    ap.add_argument("--models", type=int, default=len(MODELS), choices=range(2, len(MODELS) + 1))
    ap.add_argument("--pool", type=int, default=Shape.pool, help="engines a node runs")
    ap.add_argument("--prompt-words", type=int, default=Shape.prompt_words)
    ap.add_argument("--gen", type=int, default=Shape.gen)
    args = ap.parse_args(argv)
    shape = Shape(prompt_words=args.prompt_words, gen=args.gen, pool=args.pool)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(run(args.systems.split(","), write_models(work, args.models), work, shape,
                  start=args.start, growth=args.growth, max_load=args.max_load, reps=args.reps,
                  phase_s=args.phase_s, phases=args.phases))


if __name__ == "__main__":
    main()
