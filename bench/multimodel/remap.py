"""Parameter remapping (MIRAGE) under bursts that bind on KV: remapping off vs on, and its
one-slot / two-slot / dynamic schemes (§7.4, §7.5), in one engine stepped in process.

    python -m bench.multimodel.remap [--size tiny-deep] [--reps 5] [--bursts 3] [--burst 8]

The trace: ``--bursts`` bursts of ``--burst`` requests arriving at once (distinct prompts
of ``--prompt-words`` words, ``--gen`` greedy tokens), ``--gap-s`` apart. The KV budget
is ``--budget-frac`` of a burst's KV (at least one sequence's), so a burst does not fit:
without remapping the rest of it waits; with remapping the engine lends up to
``--max-fraction`` of its layers' weight bytes to KV. Each rep runs every variant on the
same trace, in a shuffled order (paired); ratios to "off" are per rep, reported as a mean
with a 95% interval. Tokens must equal "off"'s in every variant. A last pair runs with a
roomy budget (no KV pressure): remapping must then cost nothing (it never triggers).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.config import EngineConfig, RemapConfig
from services.engine.engine_core import EngineCore, Failure
from services.engine.model import LoadedModel, load_model, write_demo_model
from services.engine.validation import prepare
from shared.kv_layout import block_bytes

VARIANTS = ("off", "single", "double", "dynamic")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


@dataclass
class Run:
    ttft: list[float]
    tbt: list[float]
    tokens: dict[str, list[int]]
    seconds: float
    failed: int
    max_alpha: int

    @property
    def throughput(self) -> float:
        return sum(len(t) for t in self.tokens.values()) / self.seconds

    def p99(self, xs: list[float]) -> float:
        return sorted(xs)[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)] if xs else 0.0


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(10_000)}" for _ in range(words)) for _ in range(n)]


def run_trace(loaded: LoadedModel, variant: str, budget: int, args: argparse.Namespace,
              texts: list[str]) -> Run:
    remap = RemapConfig(enabled=variant != "off", scheme=variant if variant != "off"
                        else "dynamic", max_fraction=args.max_fraction, capped=args.capped)
    cfg = EngineConfig(dtype=args.dtype, device_memory_bytes=budget, page_bytes=args.page_bytes,
                       max_num_seqs=args.burst, remap=remap)
    core = EngineCore(cfg, loaded)
    arrivals = [(b * args.gap_s, f"b{b}r{i}", texts[b * args.burst + i])
                for b in range(args.bursts) for i in range(args.burst)]
    arrived: dict[str, float] = {}
    last: dict[str, float] = {}
    run = Run([], [], {}, 0.0, 0, 0)
    start = time.perf_counter()
    try:
        while arrivals or core.has_work():
            now = time.perf_counter() - start
            while arrivals and arrivals[0][0] <= now:
                _, rid, text = arrivals.pop(0)
                req = GenerateRequest(request_id=rid, prompt=text, sampling=SamplingParams(
                    max_tokens=args.gen, ignore_eos=True))
                core.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                                 vocab_size=loaded.config.vocab_size,
                                 max_model_len=core.max_model_len,
                                 fingerprint=loaded.fingerprint))
                arrived[rid] = now
            if not core.has_work():
                time.sleep(max(0.0, arrivals[0][0] - now) if arrivals else 0.0)
                continue
            for ev in core.step():
                t = time.perf_counter() - start
                if isinstance(ev, Failure):
                    run.failed += 1
                    continue
                if not ev.token_ids:
                    continue
                rid = ev.request_id
                if rid in last:
                    run.tbt.append(t - last[rid])
                else:
                    run.ttft.append(t - arrived[rid])
                last[rid] = t
                run.tokens.setdefault(rid, []).extend(ev.token_ids)
            if core.remap is not None:
                run.max_alpha = max(run.max_alpha, core.remap.streamer.plan.alpha)
        run.seconds = time.perf_counter() - start
    finally:
        core.close()
    return run


def interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.2f}x"
    half = T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{m:.2f}x [{m - half:.2f}, {m + half:.2f}]"


def burst_parser(description: str, gen: int) -> argparse.ArgumentParser:
    """The options of the remapping benches' bursty trace (this one's and the node's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--size", default="tiny-deep")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--gen", type=int, default=gen)
    ap.add_argument("--budget-frac", type=float, default=0.5)
    ap.add_argument("--max-fraction", type=float, default=0.75)
    ap.add_argument("--page-bytes", type=int, default=16 << 10)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = burst_parser(__doc__.splitlines()[0], gen=96)
    ap.add_argument("--capped", action="store_true", help="also cap α by measured times")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(write_demo_model(Path(tmp) / args.size, size=args.size),
                            dtype=getattr(torch, args.dtype))
        texts = prompts(args.bursts * args.burst, args.prompt_words, args.seed)
        mc = loaded.config
        longest = max(len(loaded.tokenizer.encode_prompt(t)) for t in texts) + args.gen + 1
        one = mc.num_layers * -(-longest // 16) * block_bytes(16, mc.num_kv_heads, mc.head_dim,
                                                             loaded.dtype.itemsize)
        budget = max(1 << 20, int(args.budget_frac * args.burst * one), 2 * one)
        roomy = 4 * args.burst * one
        print(f"{args.size} model ({args.dtype}, {mc.num_layers} layers), {args.reps} reps, "
              f"{args.bursts} bursts of {args.burst} x {args.prompt_words} words + {args.gen} "
              f"tokens; KV budget {budget / 2**20:.2f} MiB (a burst needs "
              f"{args.burst * one / 2**20:.2f}), max_fraction {args.max_fraction}, "
              f"capped {args.capped}")
        rng = random.Random(args.seed)
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        idle: dict[str, list[Run]] = {"off": [], "dynamic": []}
        for _ in range(args.reps):
            for v in rng.sample(VARIANTS, len(VARIANTS)):
                runs[v].append(run_trace(loaded, v, budget, args, texts))
            for v in rng.sample(list(idle), 2):
                idle[v].append(run_trace(loaded, v, roomy, args, texts))
    same = all(r.tokens == runs["off"][i].tokens for v in VARIANTS
               for i, r in enumerate(runs[v]))
    print("| variant | p99 TTFT s | p99 TBT s | tok/s | max α | failed | p99 TTFT vs off "
          "(lower better) | tok/s vs off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        rs, base = runs[v], runs["off"]
        med = statistics.median
        ttft = [r.p99(r.ttft) / max(1e-9, b.p99(b.ttft)) for r, b in zip(rs, base, strict=True)]
        tput = [r.throughput / b.throughput for r, b in zip(rs, base, strict=True)]
        print(f"| {v} | {med(r.p99(r.ttft) for r in rs):.3f} | "
              f"{med(r.p99(r.tbt) for r in rs):.4f} | {med(r.throughput for r in rs):.1f} | "
              f"{max(r.max_alpha for r in rs)} | {sum(r.failed for r in rs)} | "
              f"{interval(ttft)} | {interval(tput)} |")
    calm = [r.throughput / b.throughput for r, b in zip(idle["dynamic"], idle["off"],
                                                        strict=True)]
    print(f"no KV pressure (budget {roomy / 2**20:.2f} MiB): dynamic vs off tok/s "
          f"{interval(calm)}, max α {max(r.max_alpha for r in idle['dynamic'])}")
    print(f"tokens equal to off's in every variant: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
