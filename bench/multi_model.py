"""Multi-model serving (Prism §7) against two baselines, on the same trace, in one run.

    python -m bench.multi_model [--phase-s 20] [--loads 2,4,8] [--quick]

Four demo models of two sizes (two `tiny`, two `tiny-deep`, float32) on two local nodes. A
node's device budget holds every model's weights and room for KV that the hot model could
fill but all four could not at once. The trace is bursty: models take turns being hot
(most requests go to the hot one, the others get a trickle), at each load level (requests
per second over the cluster). Three systems serve it:

- prism: every node runs an engine per model, all sharing the node's budget through its
  device ledger (KV pages on demand, idle engines' pages reclaimed by the memory broker),
  requests dispatched by TTFT deadline (Algorithm 2), models placed by KV pressure
  (Algorithm 1).
- static: the same engines, each with a fixed share of the budget (its weights plus a
  quarter of the KV room).
- swap (QLM-like): one engine per node; a request for another model swaps it in whole,
  evicting the one there (from the page cache, as fast as activation here gets).

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
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from services.engine.model import write_demo_model
from services.engine.model.demo_corpus import NOUNS
from shared.model_catalog import ModelEntry, write_catalog
from tests.cluster import start_cluster

# (name, demo size, seed, TTFT SLO s): two 2-layer and two 4-layer models. Small enough
# that two CPU cores are not the bottleneck: device memory for KV is, as on a GPU.
MODELS = (("tiny-1", "tiny", 1, 0.5), ("tiny-2", "tiny", 2, 0.5),
          ("deep-1", "tiny-deep", 1, 1.0), ("deep-2", "tiny-deep", 2, 1.0))
PAGE = 16 << 10
KV_PAGES = 256  # KV room a node shares: ~17 requests of a 2-layer model, ~8 of a 4-layer one
PROMPT_WORDS = 300
GEN = 96


@dataclass
class Result:
    system: str
    load: float
    sent: int
    done: int
    met: int
    seconds: float

    @property
    def attainment(self) -> float:
        return self.met / self.sent if self.sent else 0.0

    @property
    def throughput(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


def trace(load: float, phase_s: float, phases: int, seed: int) -> list[tuple[float, str]]:
    """(send time, model): Poisson arrivals at ``load``/s; in phase k model k % 4 is hot
    (70% of the requests), the others share the rest."""
    rnd = random.Random(seed)
    names = [m[0] for m in MODELS]
    out, t = [], 0.0
    while True:
        t += rnd.expovariate(load)
        phase = int(t // phase_s)
        if phase >= phases:
            return out
        hot = names[phase % len(names)]
        model = hot if rnd.random() < 0.7 else rnd.choice([n for n in names if n != hot])
        out.append((t, model))


async def replay(url: str, reqs: list[tuple[float, str]], slo: dict[str, float],
                 seed: int) -> tuple[int, int, float]:
    """(completed, met TTFT SLO, seconds)."""
    rnd = random.Random(seed)
    done = met = 0
    start = time.monotonic()

    async def one(at: float, model: str, session: aiohttp.ClientSession) -> None:
        nonlocal done, met
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        words = " ".join(rnd.choice(NOUNS) for _ in range(PROMPT_WORDS))  # ~1 token each
        body = {"model": model, "prompt": words, "max_tokens": GEN, "temperature": 0,
                "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        first = None
        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    return
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.monotonic() - t0
        except aiohttp.ClientError:
            return
        done += 1
        if first is not None and first <= slo[model]:
            met += 1

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(at, m, session) for at, m in reqs))
    return done, met, time.monotonic() - start


def run_system(system: str, paths: dict[str, Path], loads: list[float], phase_s: float,
               phases: int, work: Path) -> list[Result]:
    weights = {n: sum(f.stat().st_size for f in p.glob("*.safetensors"))
               for n, p in paths.items()}
    kv_room = KV_PAGES * PAGE  # what the hot model could fill; not all four at once
    budget = sum(weights.values()) + kv_room
    slo = {m[0]: m[3] for m in MODELS}
    names = [m[0] for m in MODELS]
    catalog = write_catalog(work / f"{system}.yaml", [
        ModelEntry(n, str(paths[n]), ttft_slo_s=slo[n]) for n in names])
    first, rest = paths[names[0]], tuple(paths[n] for n in names[1:])
    common = {"dtype": "float32", "ready_timeout": 300.0}
    if system == "prism":
        kw = {"more_models": rest, "node_memory": budget, "models_config": catalog,
                  "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": kv_room}}
    elif system == "static":
        kw = {"more_models": rest, "models_config": catalog,
                  "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": kv_room // 4}}
    else:  # swap: one engine a node, the whole budget for the model in it
        kw = {"models_config": catalog, "node_memory": budget,
                  "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": kv_room},
                  "nodemgr_flags": {"evict_idle_s": 0}}
    out = []
    with start_cluster(work / system, first, nodes=2, **common, **kw) as cluster:
        for i, load in enumerate(loads):
            reqs = trace(load, phase_s, phases, seed=i)
            done, met, seconds = asyncio.run(replay(cluster.url, reqs, slo, seed=i))
            r = Result(system, load, len(reqs), done, met, seconds)
            print(f"  {system:6} load {load:4.1f}/s: attainment {r.attainment:6.1%}, "
                  f"{r.throughput:5.2f} req/s ({done}/{len(reqs)} done)", flush=True)
            out.append(r)
    return out


def report(results: list[Result], loads: list[float]) -> str:
    by = {(r.system, r.load): r for r in results}
    systems = ("prism", "static", "swap")
    lines = ["| load (req/s) | " + " | ".join(f"{s} attainment | {s} req/s" for s in systems)
             + " |", "| --- " * (1 + 2 * len(systems)) + "|"]
    for load in loads:
        cells = [f"{by[s, load].attainment:.1%} | {by[s, load].throughput:.2f}"
                 for s in systems]
        lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
    wins = all(by["prism", x].attainment > max(by["static", x].attainment,
                                               by["swap", x].attainment) for x in loads)
    lines.append(f"goal: higher attainment than both baselines at every load: "
                 f"{'MET' if wins else 'NOT MET'}")

    def at99(system: str) -> float:
        ok = [x for x in loads if by[system, x].attainment >= 0.99]
        return max(ok, default=0.0)

    p, s = at99("prism"), at99("static")
    ratio = p / s if s else float("inf") if p else 0.0
    lines.append(f"goal: >= 2x the load at 99% attainment of static: prism {p:g}/s, "
                 f"static {s:g}/s ({ratio:.2f}x) {'MET' if ratio >= 2 else 'NOT MET'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    # Every system runs several engines on a node's cores: none may spin between steps
    # (what the engine does by itself once it shares a device ledger; see its __main__).
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="2,4,8,16", help="requests/s over the cluster")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds a model stays hot")
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="loads 1,4; 2 phases of 8 s")
    ap.add_argument("--systems", default="prism,static,swap")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    loads = [4.0, 12.0] if args.quick else [float(x) for x in args.loads.split(",")]
    phase_s, phases = (8.0, 2) if args.quick else (args.phase_s, args.phases)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = {name: write_demo_model(work / name, size=size, seed=seed)
                 for name, size, seed, _ in MODELS}
        results: list[Result] = []
        for system in args.systems.split(","):
            print(f"{system}:", flush=True)
            results += run_system(system, paths, loads, phase_s, phases, work)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    if {r.system for r in results} == {"prism", "static", "swap"}:
        print(report(results, loads))
    else:
        print(statistics.mean(r.attainment for r in results))


if __name__ == "__main__":
    main()
