"""Batch-1 decode of one model under two engine dtypes, or two output-head kernels, paired:
which weight kernel wins end to end, and whether the two give the same greedy tokens.

    python -m bench.engine.kernel_pairs [--model NAME|DIR|FILE.gguf | --size tiny|small]
                                        [--a q4] [--b q8_0] [--head] [--pairs 10]
                                        [--prompt-len 128] [--gen 32] [--threads N]

Both engines are loaded in one process (the same file: a packaged model's Q4_1 served as
``q4`` keeps its 4-bit codes, as ``q8_0`` widens them to int8 per row at load) and decode
the same prompt one after the other, ``--pairs`` times, the order swapped every pair so
that drift on a shared host falls on both. Decode tok/s = (gen - 1) / time from the first
token to the last; the result is the mean ratio A / B with its 95% interval (a ratio whose
interval holds 1 is no difference). Greedy tokens of the two are compared: kernels that
round differently may part after some tokens (docs/configuration.md, "Weight dtypes").

``--head``: one engine of dtype ``--a`` whose int8 output head computes with int8
activations (quant/int8_dynamic.py) against the same head's codes computed by the
weight-only int8 kernel, swapped between requests (a tied head, as SmolLM2's).

Besides wall-clock tok/s it reports the process's CPU time per decoded token, paired the
same way: with one intra-op thread (``--threads 1``) that is the steps' own cost, which a
shared, loaded host changes far less than it changes the wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine.speed_workload import prompts
from bench.eval.stats import paired_ratio


async def _decode(engine, ids: list[int], gen: int) -> tuple[float, float, list[int]]:
    """(decode tok/s, CPU ms a decoded token, the tokens) of one greedy request."""
    from services.engine.api_types import GenerateRequest, SamplingParams

    req = GenerateRequest(prompt_token_ids=tuple(ids),
                          sampling=SamplingParams(max_tokens=gen, ignore_eos=True))
    tokens: list[int] = []
    first = cpu = 0.0
    async for out in engine.generate(req):
        if not tokens:
            first, cpu = time.perf_counter(), time.process_time()
        tokens += out.token_ids
    n = len(tokens) - 1
    return (n / (time.perf_counter() - first), (time.process_time() - cpu) * 1e3 / n, tokens)


class _Heads:
    """Engine 0's output head swapped between its own kernel and the weight-only int8 one
    over the same codes (``--head``); ``use(i)`` between requests."""

    def __init__(self, engine) -> None:
        from services.engine.model.quant import kernel_dtype, make_linear

        self.model = engine.loaded.model
        embed = self.model.quant_embed
        if embed is None or not self.model.config.tie_word_embeddings:
            raise SystemExit("--head needs a quantized model with a tied head")
        self.heads = (self.model.head,
                      make_linear([embed.groups()], None, kernel_dtype(torch.float32), True))

    def use(self, i: int) -> None:
        self.model.head = self.heads[i]


async def measure(model: str, dtypes: tuple[str, str], pairs: int, prompt_len: int,
                  gen: int, head: bool = False, threads: int = 0) -> dict:
    """{"tps": (A's tok/s, B's), "cpu": (A's CPU ms a token, B's), "tokens": (A's, B's),
    "weights": (bytes, bytes)}."""
    from contextlib import AsyncExitStack

    from services.engine.async_engine import AsyncEngine
    from services.engine.config import EngineConfig
    from services.engine.model_slot import weight_bytes

    async with AsyncExitStack() as stack:
        engines = []
        for dtype in dtypes[:1] if head else dtypes:
            cfg = EngineConfig(model_path=model, dtype=dtype, device_memory_bytes=256 << 20,
                               max_num_seqs=4, max_queue_delay_s=0.0, num_threads=threads)
            engines.append(await stack.enter_async_context(AsyncEngine(cfg)))
        heads = _Heads(engines[0]) if head else None

        def engine(i: int):
            if heads is None:
                return engines[i]
            heads.use(i)  # (between requests: the worker thread is idle)
            return engines[0]

        vocab = engines[0].loaded.config.vocab_size
        ids = prompts(1, prompt_len, vocab, seed=17)[0]
        tokens = [(await _decode(engine(i), ids, gen))[2] for i in (0, 1)]  # and warm-up
        tps: tuple[list[float], list[float]] = ([], [])
        cpu: tuple[list[float], list[float]] = ([], [])
        for p in range(pairs):
            for i in (0, 1) if p % 2 == 0 else (1, 0):
                t, c, _ = await _decode(engine(i), ids, gen)
                tps[i].append(t)
                cpu[i].append(c)
        if heads is not None:
            heads.use(0)
        weights = tuple(weight_bytes(engine(i).loaded.model) for i in (0, 1))
        return {"tps": tps, "cpu": cpu, "tokens": tuple(tokens), "weights": weights}


def report(res: dict, names: tuple[str, str], prompt_len: int, gen: int) -> list[str]:
    (a, b), (ta, tb) = res["tps"], res["tokens"]
    r, rc = paired_ratio(a, b), paired_ratio(res["cpu"][1], res["cpu"][0])
    same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)

    def verdict(x) -> str:
        return ("no difference" if x.low <= 1.0 <= x.high
                else f"{names[0] if x.low > 1.0 else names[1]} faster")

    wa, wb = (w / 2**20 for w in res["weights"])
    ca, cb = (statistics.fmean(c) for c in res["cpu"])
    return [
        f"batch-1 decode, prompt {prompt_len}, {gen} tokens, {r.n} interleaved pairs, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f} (1-min average "
        "at the end)",
        f"{names[0]}: {statistics.fmean(a):.1f} tok/s, {ca:.2f} CPU ms a token (weights "
        f"{wa:.0f} MiB); {names[1]}: {statistics.fmean(b):.1f} tok/s, {cb:.2f} CPU ms a token "
        f"(weights {wb:.0f} MiB)",
        f"{names[0]} / {names[1]} tok/s: {r.fmt(1, 3, 'x')} (mean ratio, 95% interval): "
        f"{verdict(r)}",
        f"{names[1]} / {names[0]} CPU a token: {rc.fmt(1, 3, 'x')} (mean ratio, 95% interval): "
        f"{verdict(rc)}",
        "greedy tokens: identical" if same is None
        else f"greedy tokens: part at token {same} of {len(ta)}",
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="",
                    help="a packaged model's name, a model folder or a .gguf file "
                    "[default: write the --size demo model]")
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--a", default="q4", help="engine dtype A [q4]")
    ap.add_argument("--b", default="q8_0", help="engine dtype B [q8_0]")
    ap.add_argument("--head", action="store_true",
                    help="one engine of dtype --a: its int8 head with int8 activations "
                    "against the weight-only int8 kernel")
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads [default: the engine's]")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args(argv)
    dtypes = (args.a, args.b)
    names = ("int8-activation head", "weight-only head") if args.head else dtypes
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            from services.models.commands import model_folder

            # one folder for both: the engine quantizes or widens at load
            model = str(model_folder(args.model, "q4", Path(".overture/models")))
        else:
            from services.engine.model import write_demo_model

            model = str(write_demo_model(Path(tmp) / f"demo-{args.size}", size=args.size))
        res = asyncio.run(measure(model, dtypes, args.pairs, args.prompt_len, args.gen,
                                  args.head, args.threads))
    print("\n".join(report(res, names, args.prompt_len, args.gen)))


if __name__ == "__main__":
    main()
