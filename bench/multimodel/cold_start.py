"""Where a cold start's time to first token goes, with and without the node's Reuse Store
(issue 46): one engine of an engine pool activates a model, then serves its first
requests, on privately loaded weights or on views into the store's arena.

    python -m bench.multimodel.cold_start [--size tiny-deep] [--reps 5] [--requests 2]
        [--prompt-words 300] [--gen 96] [--batch 4]

Each repetition runs the variants in a rotated order in one standby engine (one
intra-op thread, as the multi-model bench's engines):
- private: ``activate`` from the page cache, each engine its own copy (today's pool);
- store 0%: through a fresh arena (every tensor written into it first);
- store 100%: the model resident in the arena from an earlier activation (evicted from
  its engine since): the store's cold start in the multi-model bench.
Then ``--requests`` requests one after the other (TTFT: the prefill of the prompt; TPOT:
the mean of the decode steps after it), then ``--batch`` requests at once (the decode
steps of a batch, where a weight's layout matters most), then the model is evicted.
Reported per part with 95% intervals, and private over each store variant paired per
repetition; the store's parts must not be slower than private's for its activation
gain to reach the TTFT. Every variant's greedy tokens must equal private's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.eval.stats import mean_interval, paired_ratio
from bench.multimodel.page_cache import read_into_page_cache
from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import write_demo_model
from services.engine.model.demo_corpus import NOUNS
from services.engine.model.mapped import StoredTensor, StoredWeights
from services.nodemgr.reuse_store import ReuseStore, ShmArena, index_model

VARIANTS = ("private", "store 0%", "store 100%")
DTYPE = "float32"


@dataclass
class Parts:
    """Seconds of each part of one cold start, and the tokens it gave."""
    activation: float = 0.0
    ttft: list[float] = field(default_factory=list)  # per sequential request
    tpot: list[float] = field(default_factory=list)
    batch_tpot: float = 0.0  # the batch's decode: wall seconds a step
    tokens: list[tuple[int, ...]] = field(default_factory=list)


async def one_request(eng: AsyncEngine, prompt: str, gen: int) -> tuple[float, float,
                                                                       tuple[int, ...]]:
    """(TTFT, mean seconds of a decode step after it, the tokens) of one greedy request."""
    req = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=gen,
                                                                 ignore_eos=True))
    started = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    async for out in eng.generate(req):
        last = time.perf_counter()
        if not tokens and out.token_ids:
            first = last
        tokens.extend(out.token_ids)
    decode = (last - first) / max(1, len(tokens) - 1)
    return first - started, decode, tuple(tokens)


async def batch(eng: AsyncEngine, prompts: list[str], gen: int) -> tuple[float, list[
        tuple[int, ...]]]:
    """Seconds a decode step of ``prompts`` served together (from the last first token
    to the last token), and each one's tokens."""
    got = await asyncio.gather(*(one_request(eng, p, gen) for p in prompts))
    return sum(d for _, d, _ in got) / len(got), [t for _, _, t in got]


class Bench:
    def __init__(self, path: Path, work: Path, args: argparse.Namespace) -> None:
        self.path, self.work, self.args = path, work, args
        self.index = index_model("m", path, DTYPE)
        self.arena_bytes = self.index.total_bytes + (16 << 20)
        self.resident = self._store()  # the "store 100%" arena: the model stays in it
        self.prompts = self._prompts()

    def _store(self) -> ReuseStore:
        store = ReuseStore(ShmArena(self.arena_bytes, str(self.work)), dtype=DTYPE)
        store.add_index(self.index)
        return store

    def _prompts(self) -> list[str]:
        rnd = random.Random(0)
        return [" ".join(rnd.choice(NOUNS) for _ in range(self.args.prompt_words))
                for _ in range(self.args.requests + self.args.batch)]

    async def one(self, eng: AsyncEngine, variant: str) -> Parts:
        parts = Parts()
        store = None if variant == "private" else (
            self.resident if variant == "store 100%" else self._store())
        read_into_page_cache(self.path)
        try:
            started = time.perf_counter()
            if store is None:
                await eng.activate(str(self.path))
            else:
                plan = store.plan("m")
                await eng.activate(str(self.path), stored=StoredWeights(
                    store.arena.path, store.arena.nbytes, store.dtype,
                    tuple(StoredTensor(m.name, m.offset, m.nbytes, m.fill) for m in plan)))
                store.committed("m", eng.last_fill[1])
            parts.activation = time.perf_counter() - started
            n, gen = self.args.requests, self.args.gen
            for prompt in self.prompts[:n]:
                ttft, tpot, tokens = await one_request(eng, prompt, gen)
                parts.ttft.append(ttft)
                parts.tpot.append(tpot)
                parts.tokens.append(tokens)
            if self.args.batch:
                parts.batch_tpot, toks = await batch(eng, self.prompts[n:], gen)
                parts.tokens.extend(toks)
            await eng.evict()
            if store is not None:
                store.deactivated("m")
        finally:
            if store is not None and store is not self.resident:
                store.arena.close()
        return parts

    async def run(self) -> dict[str, list[Parts]]:
        cfg = EngineConfig(model_path="", standby=True, dtype=DTYPE, num_threads=1,
                           device_memory_bytes=64 << 20, page_bytes=64 << 10,
                           max_queue_delay_s=0.0)  # (serve all: a batch of long prefills)
        got: dict[str, list[Parts]] = {v: [] for v in VARIANTS}
        async with AsyncEngine(cfg) as eng:
            await self.one(eng, "store 100%")  # (makes it resident; untimed)
            for rep in range(self.args.reps):
                order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
                for v in order:
                    got[v].append(await self.one(eng, v))
        self.resident.arena.close()
        return got


def _nth(part: str, i: int, p: Parts) -> float:
    """The ``i``-th sequential request's ``part`` ("ttft" or "tpot")."""
    values: list[float] = getattr(p, part)
    return values[i]


def report(got: dict[str, list[Parts]], args: argparse.Namespace) -> list[str]:
    base = got["private"]
    cols: list[tuple[str, Callable[[Parts], float]]] = [
        ("activation", lambda p: p.activation)]
    for i in range(args.requests):
        cols += [(f"TTFT #{i + 1}", functools.partial(_nth, "ttft", i)),
                 (f"TPOT #{i + 1}", functools.partial(_nth, "tpot", i))]
    if args.batch:
        cols.append((f"TPOT, batch of {args.batch}", lambda p: p.batch_tpot))
    if args.requests:
        cols.append(("cold-start TTFT", lambda p: p.activation + p.ttft[0]))
    lines = ["| part (ms) | " + " | ".join(VARIANTS) + " | "
             + " | ".join(f"private / {v}" for v in VARIANTS[1:]) + " |",
             "| --- " * (2 * len(VARIANTS)) + "|"]
    for name, f in cols:
        cells = [mean_interval([f(p) for p in got[v]]).fmt(scale=1e3, digits=2)
                 for v in VARIANTS]
        ratios = [paired_ratio([f(p) for p in base], [f(p) for p in got[v]]).fmt(
            digits=2, unit="x") for v in VARIANTS[1:]]
        lines.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    same = all(p.tokens == q.tokens for v in VARIANTS
               for p, q in zip(got[v], base, strict=True))
    lines.append("(cold-start TTFT: the activation plus the first request's TTFT)")
    lines.append(f"tokens equal to private's in every variant: {'yes' if same else 'NO'}")
    return lines


def main(argv: list[str] | None = None) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # (as the multi-model bench's engines)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny-deep", help="demo model size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2, help="sequential requests a start")
    ap.add_argument("--batch", type=int, default=4, help="then this many at once (0: none)")
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--gen", type=int, default=96)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="overture-bench-") as tmp:
        work = Path(tmp)
        path = write_demo_model(work / "m", size=args.size, seed=1)
        got = asyncio.run(Bench(path, work, args).run())
    print(f"{args.size} model ({DTYPE}), {args.reps} reps, prompts of {args.prompt_words} "
          f"words, {args.gen} tokens, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; ms, mean [95% CI]:")
    print("\n".join(report(got, args)))


if __name__ == "__main__":
    main()
