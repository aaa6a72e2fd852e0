"""Multi-model serving (Prism §7) against two baselines, on the same trace, in one run.

    python -m bench.multimodel.load [--loads 4,8,12] [--phase-s 8] [--phases 8] [--quick]
        [--systems prism,static,swap] [--models 4]
    python -m bench.multimodel.search ...   (pool against pool-store, searching the load)

Four demo models of two sizes (two `tiny`, two `tiny-deep`, float32) on two local nodes. A
node's device budget holds every model's weights and room for KV that the hot model could
fill but all four could not at once. The trace is bursty: models take turns being hot
(most requests go to the hot one, the others get a trickle), at each load level (requests
per second over the cluster). Three systems serve it:

- prism: every node runs an engine per model, all sharing the node's budget through its
  device ledger (KV pages on demand, idle engines' pages reclaimed by the memory broker,
  a reserve of ``--kv-reserve-pages`` per engine, §6.3), requests dispatched by TTFT
  deadline (Algorithm 2), models placed by KV pressure (Algorithm 1).
- static: the same engines, each with a fixed share of the budget (its weights plus a
  quarter of the KV room) and its own first-come-first-served queue, as when each model
  runs its own server with a fixed memory fraction.
- swap (QLM-like): one engine per node, with the whole room; a request for a model neither
  node holds swaps it in whole once the model there is idle (from the page cache, as fast
  as activation here gets), and waits for that.
- static-dl (an ablation, with ``--systems``): static's fixed shares behind prism's node
  queue ordered by deadline (Algorithm 2): what elastic memory adds by itself.
- pool, pool-store (``bench.multimodel.search``'s defaults): prism's node with ``--pool``
  engines for the four models, which are evicted and activated (cold starts), without
  and with the node's Reuse Store (Tangram).

No system refuses a request for being late: prism serves the ones Algorithm 2 cannot
save after the others (issue 24), and the baselines' engines queue them as a server of
their own would (``engine.max_queue_delay_s`` 0), so all three do the same work.

For each system and load: TTFT SLO attainment (the share of requests whose first token
came within their model's TTFT SLO) and throughput (requests completed per second).
Goals (issue 24): higher attainment than both baselines at every load; at least 2x the
load at 99% attainment of static partitioning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.harness import start_cluster
from bench.multimodel.clusters import MODELS, Shape, cluster_setup, slos, write_models
from services.engine.model.demo_corpus import NOUNS


@dataclass
class Result:
    system: str
    load: float
    sent: int
    done: int
    met: int
    seconds: float
    per_model: dict[str, tuple[int, int]]  # model -> (met, sent)

    @property
    def attainment(self) -> float:
        return self.met / self.sent if self.sent else 0.0

    @property
    def throughput(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


def trace(load: float, phase_s: float, phases: int, seed: int, names: list[str]
          ) -> list[tuple[float, str]]:
    """(send time, model): Poisson arrivals at ``load``/s; in phase k model k % 4 (of four
    ``names``) is hot (70% of the requests), the others share the rest."""
    rnd = random.Random(seed)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rnd.expovariate(load)
        phase = int(t // phase_s)
        if phase >= phases:
            return out
        hot = names[phase % len(names)]
        model = hot if rnd.random() < 0.7 else rnd.choice([n for n in names if n != hot])
        out.append((t, model))


@dataclass
class Sample:
    """One request of a replay: when it was sent, to which model, its time to first token
    (None if it failed) and when it ended (seconds from the start)."""
    at: float
    model: str
    ttft: float | None = None
    ended: float = 0.0
    status: int = 0  # HTTP status (0: the connection failed)
    activation_s: float = 0.0  # > 0: it waited this long for its model's activation


async def replay(url: str, reqs: list[tuple[float, str]], seed: int, shape: Shape
                 ) -> tuple[list[Sample], float]:
    """Every request's sample, and the seconds the replay took."""
    rnd = random.Random(seed)
    samples = [Sample(at, model) for at, model in reqs]
    start = time.monotonic()

    async def one(s: Sample, session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(max(0.0, start + s.at - time.monotonic()))
        words = " ".join(rnd.choice(NOUNS) for _ in range(shape.prompt_words))
        body = {"model": s.model, "prompt": words, "max_tokens": shape.gen,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        first = None
        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                s.status = r.status
                if r.status != 200:
                    return
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.monotonic() - t0
                    if b'"model_activation_s"' in line:  # (the usage chunk, at the end)
                        usage = json.loads(line[len(b"data: "):])["usage"]
                        s.activation_s = float(usage["model_activation_s"])
        except aiohttp.ClientError:
            return
        s.ttft, s.ended = first, time.monotonic() - start

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(s, session) for s in samples))
    return samples, time.monotonic() - start


def summarize(system: str, load: float, samples: list[Sample], seconds: float,
              slo: dict[str, float]) -> Result:
    def met(s: Sample) -> bool:
        return s.ttft is not None and s.ttft <= slo[s.model]

    per_model = {m: (sum(1 for s in samples if s.model == m and met(s)),
                     sum(1 for s in samples if s.model == m)) for m in slo}
    return Result(system, load, len(samples), sum(1 for s in samples if s.ttft is not None),
                  sum(1 for s in samples if met(s)), seconds, per_model)


def run_system(system: str, paths: dict[str, Path], loads: list[float], phase_s: float,
               phases: int, work: Path, shape: Shape, samples_to: str = "") -> list[Result]:
    slo = slos(paths)
    first, kw = cluster_setup(system, paths, work, shape)
    out = []
    with start_cluster(work / system, first, **kw) as cluster:
        for i, load in enumerate(loads):
            reqs = trace(load, phase_s, phases, seed=i, names=list(slo))
            samples, seconds = asyncio.run(replay(cluster.url, reqs, i, shape))
            r = summarize(system, load, samples, seconds, slo)
            per_model = ", ".join(f"{m} {met}/{n}" for m, (met, n) in r.per_model.items())
            print(f"  {system:6} load {load:4.1f}/s: attainment {r.attainment:6.1%}, "
                  f"{r.throughput:5.2f} req/s ({r.done}/{r.sent} done; met by model: "
                  f"{per_model})", flush=True)
            if samples_to:
                with open(samples_to, "a") as f:
                    f.write(json.dumps({"system": system, "load": load,
                                        "samples": [x.__dict__ for x in samples]}) + "\n")
            out.append(r)
    return out


def report(results: list[Result], loads: list[float]) -> str:
    """The table of every system that ran, and the goals when prism and both baselines did."""
    by = {(r.system, r.load): r for r in results}
    systems = [s for s in ("prism", "static", "swap", "static-dl")
               if any(r.system == s for r in results)]
    lines = ["| load (req/s) | " + " | ".join(f"{s} attainment | {s} req/s" for s in systems)
             + " |", "| --- " * (1 + 2 * len(systems)) + "|"]
    for load in loads:
        cells = [f"{by[s, load].attainment:.1%} | {by[s, load].throughput:.2f}"
                 for s in systems]
        lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
    if {"prism", "static", "swap"} <= set(systems):
        lines += goals(by, loads)
    else:
        lines.append("goals: not judged (they need prism, static and swap in one run)")
    return "\n".join(lines)


def goals(by: dict[tuple[str, float], Result], loads: list[float]) -> list[str]:
    lines = []
    # "Higher at every load": never lower, and higher wherever a baseline missed any
    # request (where both meet every SLO, 100% cannot be beaten).
    def beats(base: str, x: float) -> bool:
        p, b = by["prism", x].attainment, by[base, x].attainment
        return p > b or p == b == 1.0

    ties = [x for x in loads if all(by[s, x].attainment == 1.0 for s in ("prism", "static"))]
    wins = all(beats(b, x) for b in ("static", "swap") for x in loads)
    lines.append(f"goal: higher attainment than both baselines at every load: "
                 f"{'MET' if wins else 'NOT MET'}"
                 + (f" (prism and static both 100% at {', '.join(f'{x:g}' for x in ties)})"
                    if ties else ""))

    def at99(system: str) -> float:
        """The highest load up to which every load tested held 99% (a load under 99%
        ends it, whatever a higher one did)."""
        held = 0.0
        for x in sorted(loads):
            if by[system, x].attainment < 0.99:
                break
            held = x
        return held

    def first_below(system: str) -> str:
        low = [x for x in loads if by[system, x].attainment < 0.99]
        return f"{min(low):g}/s" if low else "none"

    p, s = at99("prism"), at99("static")
    # Static under 99% at the lowest load tested: no ratio can be read (test lower loads).
    verdict = ("NOT DETERMINED (static under 99% at every load)" if not s
               else f"({p / s:.2f}x) {'MET' if p >= 2 * s else 'NOT MET'}")
    lines.append(f"goal: >= 2x the load at 99% attainment of static: prism {p:g}/s, "
                 f"static {s:g}/s {verdict} "
                 f"(first load under 99%: prism {first_below('prism')}, "
                 f"static {first_below('static')})")
    return lines


def main(argv: list[str] | None = None) -> None:
    # Every system runs several engines on a node's cores: none may spin between steps
    # (what the engine does by itself once it shares a device ledger; see its __main__).
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="4,8,12", help="requests/s over the cluster")
    ap.add_argument("--phase-s", type=float, default=8.0, help="seconds a model stays hot")
    ap.add_argument("--phases", type=int, default=8, help="each model is hot phases/4 times")
    ap.add_argument("--quick", action="store_true", help="loads 4,8; 4 phases of 8 s")
    ap.add_argument("--systems", default="prism,static,swap")
    ap.add_argument("--models", type=int, default=len(MODELS), choices=range(2, len(MODELS) + 1),
                    help=f"serve the first N of the {len(MODELS)} models (fewer engines: a smoke "
                    "run)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--samples", default="", help="append every request's TTFT here")
    ap.add_argument("--kv-pages", type=int, default=Shape.kv_pages)
    ap.add_argument("--prompt-words", type=int, default=Shape.prompt_words)
    ap.add_argument("--gen", type=int, default=Shape.gen)
    ap.add_argument("--engine-threads", type=int, default=Shape.engine_threads)
    ap.add_argument("--kv-reserve-pages", type=int, default=Shape.kv_reserve_pages)
    ap.add_argument("--pool", type=int, default=Shape.pool,
                    help="pool, pool-store: engines a node runs (fewer than the models)")
    args = ap.parse_args(argv)
    loads = [4.0, 8.0] if args.quick else [float(x) for x in args.loads.split(",")]
    phase_s, phases = (8.0, 4) if args.quick else (args.phase_s, args.phases)
    shape = Shape(args.kv_pages, args.prompt_words, args.gen, args.engine_threads,
                  args.kv_reserve_pages, args.pool)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = write_models(work, args.models)
        results: list[Result] = []
        for system in args.systems.split(","):
            print(f"{system}:", flush=True)
            results += run_system(system, paths, loads, phase_s, phases, work, shape,
                                  args.samples)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    print(report(results, loads))


if __name__ == "__main__":
    main()
