"""Calibrate the simulator through a running cluster, as the evaluation sees the engines.

    python -m bench.sim.calibrate_cluster --base bench/sim/calibration-cpu-small.json \\
        --out bench/sim/calibration-cluster-quick.json [--size small] [--quick]

``calibrate.py`` times the bare engine step; a request through ``overture up`` also pays
HTTP, gRPC and streaming, and two engines share this machine's two cores with their
kvstores, node managers, the scheduler and the client. This starts the evaluation's
quick-profile cluster (``bench/eval/profiles.py``), times first tokens of prompts of
several lengths one at a time (nothing cached: every prompt is new text) and tokens per
second of several concurrent streams, and fits the same cost model: the prefill terms are
the bare engine's scaled by the measured cost per token, what is left of a first token is
``request_overhead_s``, and the decode step is fitted on the measured streams.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.eval.profiles import BALANCED, QUICK
from bench.harness import overture_up, show_progress
from bench.sim.costs import Calibration
from bench.workloads.replay import stream_chat
from bench.workloads.trace import WORDS


@dataclasses.dataclass(frozen=True)
class Plan:
    """What is timed: first tokens of prompts of ``prompts`` words (about as many tokens),
    ``reps`` each, and ``decode_tokens`` tokens of each of ``streams`` concurrent requests
    over the two nodes."""

    prompts: tuple[int, ...] = (32, 160, 400, 800)
    reps: int = 3
    streams: tuple[int, ...] = (1, 2, 4, 8)
    decode_tokens: int = 48


FULL = Plan()
QUICK_PLAN = Plan(prompts=(32, 160), reps=1, streams=(1, 2), decode_tokens=8)  # a smoke run


async def _one(http: aiohttp.ClientSession, url: str, model: str, text: str,
               max_tokens: int) -> tuple[float, float, int, int]:
    """(TTFT, end to end, prompt tokens, output tokens) of one streamed request."""
    got = await stream_chat(http, url, {
        "model": model, "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    if got.error:
        raise RuntimeError(f"calibration request failed: {got.error}")
    return got.ttft_s, got.e2e_s, got.prompt_tokens, got.completion_tokens


async def measure(url: str, model: str, rng: random.Random, plan: Plan = FULL
                  ) -> tuple[list[tuple[int, float]], list[tuple[float, float]]]:
    """First-token times by prompt tokens, and decode step times by streams per node."""
    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    prefill, decode = [], []
    async with aiohttp.ClientSession() as http:
        for _ in range(3):  # warm-up
            await _one(http, url, model, text(200), 4)
        for words in plan.prompts:
            for _ in range(plan.reps):
                ttft, _, prompt, _ = await _one(http, url, model, text(words), 1)
                prefill.append((prompt, ttft))
        for n in plan.streams:
            got = await asyncio.gather(*(_one(http, url, model, text(24), plan.decode_tokens)
                                         for _ in range(n)))
            tpot = statistics.mean((e2e - ttft) / max(1, out - 1) for ttft, e2e, _, out in got)
            decode.append((n / 2, tpot))  # (balanced spreads the streams over both nodes)
    return prefill, decode


def fit(base: Calibration, prefill: list[tuple[int, float]],
        decode: list[tuple[float, float]]) -> Calibration:
    x = np.array([[1.0, n] for n, _ in prefill])
    (a, b), *_ = np.linalg.lstsq(x, np.array([t for _, t in prefill]), rcond=None)
    scale = max(b, 1e-9) / base.prefill_s_per_token
    prefill_base = base.prefill_base_s * scale
    x = np.array([[1.0, n] for n, _ in decode])
    (d0, d1), *_ = np.linalg.lstsq(x, np.array([t for _, t in decode]), rcond=None)
    ctx_scale = d0 / base.decode_base_s if base.decode_base_s else 1.0
    return dataclasses.replace(
        base, name=f"{base.name}-cluster",
        source=f"bench.sim.calibrate_cluster over {base.name} through a 2-node overture up "
        f"cluster (quick profile); {time.strftime('%Y-%m-%d')}",
        prefill_base_s=prefill_base, prefill_s_per_token=float(b),
        prefill_s_per_token_ctx=base.prefill_s_per_token_ctx * scale,
        request_overhead_s=max(0.0, float(a) - prefill_base),
        decode_base_s=max(1e-4, float(d0)), decode_s_per_seq=max(0.0, float(d1)),
        decode_s_per_ctx_token=base.decode_s_per_ctx_token * ctx_scale,
        device_kv_bytes=QUICK.device_memory_bytes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="bench/sim/calibration-cpu-small.json")
    ap.add_argument("--out", default="bench/sim/calibration-cluster-quick.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="small", choices=("tiny", "small"),
                    help="the demo model the cluster serves [small]")
    ap.add_argument("--quick", action="store_true",
                    help="two prompt lengths, one repetition, 1 and 2 streams (a smoke run)")
    args = ap.parse_args(argv)
    show_progress()
    base = Calibration.load(args.base)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="overture-sim-cal-") as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(BALANCED.config(QUICK.device_memory_bytes))
        with overture_up(Path(tmp), size=args.size, extra_args=["--config", str(config)],
                         label="calibrate") as cluster:
            prefill, decode = asyncio.run(measure(cluster.url, cluster.model,
                                                  random.Random(args.seed),
                                                  QUICK_PLAN if args.quick else FULL))
    cal = fit(base, prefill, decode)
    cal.save(args.out)
    print("first tokens (prompt tokens, s):", [(n, round(t, 3)) for n, t in prefill])
    print("decode steps (streams per node, s):", [(n, round(t, 4)) for n, t in decode])
    print(f"[{time.monotonic() - t0:.0f} s] wrote {args.out}: prefill {cal.prefill_base_s:.4f} "
          f"+ {cal.prefill_s_per_token * 1000:.3f} ms/token, overhead "
          f"{cal.request_overhead_s * 1000:.0f} ms, decode {cal.decode_base_s * 1000:.1f} + "
          f"{cal.decode_s_per_seq * 1000:.2f} ms/seq")


if __name__ == "__main__":
    main()
