"""Decode speed of a batch mixing one long conversation with short ones.

    python -m bench.engine.decode_mixed [--long 2048] [--short 256] [--batch 8] [--tokens 32]
        [--rounds 4] [--size small]

One request with a ``--long``-token prompt and ``batch - 1`` with ``--short``-token prompts,
submitted together to an in-process AsyncEngine (the `small` demo model, fp32), each
generating ``--tokens`` greedy tokens. Decode tokens/s (after every first token) for:

- grouped   decodes attended in groups of similar context length (the engine's default,
            ``paged_attention.group_by_length``)
- padded    every decode padded to the longest context in one SDPA call (the baseline:
            ``GROUP_CALL_KEYS`` so large that one group always wins)

Modes alternate within a round (the first of a round alternates too), fresh prompts per
round, the device cache dropped before each; the greedy tokens of both must be identical.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import paged_attention, write_demo_model

PADDED = 10**12  # a group call costing this many keys: one group always wins


async def _round(eng, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s once every request has its first token: tokens that arrive after
    that moment over the time they took (short requests may be decoding while the long
    prompt is still in prefill; their earlier tokens are not counted)."""
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    arrivals: list[tuple[float, int]] = []  # (time, tokens) of every streamed piece
    firsts: list[float] = []
    outs: list[list[int]] = [[] for _ in batch]

    async def one(i: int, ids: list[int]) -> None:
        async for o in eng.generate(GenerateRequest(prompt_token_ids=tuple(ids), sampling=sp)):
            now = time.perf_counter()
            if not outs[i]:
                firsts.append(now)
            outs[i].extend(o.token_ids)
            arrivals.append((now, len(o.token_ids)))

    await eng.drop_device_cache()  # every mode prefills the same prompts from scratch
    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    t_end = time.perf_counter()
    start = max(firsts)
    decoded = sum(n for t, n in arrivals if t > start)
    return decoded / (t_end - start), outs


async def _main(args: argparse.Namespace) -> None:
    default_keys = paged_attention.GROUP_CALL_KEYS
    try:
        rates = await _rates(args, default_keys)
    finally:
        paged_attention.GROUP_CALL_KEYS = default_keys
    grouped, padded = (statistics.median(rates[m]) for m in ("grouped", "padded"))
    print(f"decode, 1 x {args.long} + {args.batch - 1} x {args.short} tokens of context, "
          f"{args.tokens} tokens each (median of {args.rounds} rounds; greedy tokens identical)")
    print(f"  padded   {padded:8.1f} tokens/s")
    print(f"  grouped  {grouped:8.1f} tokens/s   {grouped / padded:5.2f}x padded")


async def _rates(args: argparse.Namespace, default_keys: int) -> dict[str, list[float]]:
    """Decode tokens/s of every round, by mode (the group-call cost left at PADDED or
    ``default_keys``: the caller restores it)."""
    with tempfile.TemporaryDirectory(prefix="overture-bench-") as tmp:
        model = write_demo_model(Path(tmp) / args.size, size=args.size, seed=0)
        cfg = EngineConfig(model_path=str(model), dtype="float32", device_memory_bytes=2 << 30,
                           max_num_seqs=max(8, args.batch), max_num_batched_tokens=2048,
                           max_queue_delay_s=0.0)  # a closed batch: no admission
        async with AsyncEngine(cfg) as eng:
            vocab = eng.loaded.config.vocab_size
            g = torch.Generator().manual_seed(0)

            def batch() -> list[list[int]]:
                lens = [args.long] + [args.short] * (args.batch - 1)
                return [torch.randint(16, vocab, (n,), generator=g).tolist() for n in lens]

            await _round(eng, batch(), 4)  # warm-up
            rates: dict[str, list[float]] = {"grouped": [], "padded": []}
            for r in range(args.rounds):
                prompts = batch()
                got = {}
                order = ("grouped", "padded") if r % 2 == 0 else ("padded", "grouped")
                for mode in order:
                    paged_attention.GROUP_CALL_KEYS = default_keys if mode == "grouped" else PADDED
                    rate, got[mode] = await _round(eng, prompts, args.tokens)
                    rates[mode].append(rate)
                assert got["grouped"] == got["padded"], "greedy tokens differ between modes"
    return rates


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--short", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4, help="an even number")
    ap.add_argument("--size", default="small", choices=("tiny", "small"),
                    help="the demo model (tiny: a smoke run)")
    args = ap.parse_args(argv)
    if args.batch < 2 or min(args.long, args.short, args.tokens) < 2:
        ap.error("--batch, --long, --short and --tokens must be at least 2")
    if args.rounds < 2 or args.rounds % 2:
        ap.error("--rounds must be even: each mode goes first in half of them")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
