"""Weight memory lent to KV across a node (MIRAGE §5.2): two models on one device budget,
bursts on one of them bind on KV while the other is idle.

    python -m bench.multimodel.remap_node [--reps 5] [--bursts 3] [--burst 8]

Both engines run in process on one device ledger (the node's budget: both models' weights
and ``--budget-frac`` of a burst's KV, each engine's pool that much too); the node's
memory broker (``MemoryBroker``, the
nodemgr's) runs a round every ``--broker-s`` of the trace. Variants, paired (the same
trace, a shuffled order each rep):

    off    no remapping: the rest of a burst waits for KV
    own    the busy engine lends its own layers (``engine.remap``), nobody else's
    node   the broker first asks the idle engine to lend its layers to the node's budget
           (``nodemgr.lend_weights``: idle models before the active one); the busy engine
           lends its own only once KV stays short ``node_grace_s``

Ratios to "off" are per rep, as a mean with a 95% interval; the busy model's tokens must
equal "off"'s, and nothing may stay lent after the trace (reversion).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.multimodel.remap import Run, burst_parser, interval, prompts
from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.config import EngineConfig, RemapConfig
from services.engine.engine_core import EngineCore, Failure
from services.engine.model import LoadedModel, load_model, write_demo_model
from services.engine.model_slot import weight_bytes
from services.engine.remap import layer_bytes
from services.engine.validation import prepare
from services.nodemgr.memory_broker import EngineMemory, MemoryBroker
from services.nodemgr.weight_lending import Lender
from shared.device_ledger import DeviceLedger, create_ledger
from shared.kv_layout import block_bytes

VARIANTS = ("off", "own", "node")


class Node:
    """Two engines on one ledger and the node's broker over them."""

    def __init__(self, models: dict[str, LoadedModel], variant: str, kv_budget: int,
                 args: argparse.Namespace, tmp: Path) -> None:
        path = create_ledger(tmp / f"ledger-{variant}",
                             sum(weight_bytes(m.model) for m in models.values()) + kv_budget)
        self.ledgers: list[DeviceLedger] = []
        self.cores: dict[str, EngineCore] = {}
        for name, loaded in models.items():
            ledger = DeviceLedger(path)
            ledger.join(name)
            ledger.take(weight_bytes(loaded.model), weights=True)  # (as the model slot does)
            remap = RemapConfig(enabled=variant != "off", max_fraction=args.max_fraction,
                                capped=False)
            cfg = EngineConfig(dtype=args.dtype, device_memory_bytes=kv_budget,
                               page_bytes=args.page_bytes, max_num_seqs=args.burst,
                               remap=remap)  # (Prism's set-up: a pool is the node's room)
            self.cores[name] = EngineCore(cfg, loaded, ledger=ledger)
            self.ledgers.append(ledger)
        self.broker = MemoryBroker(self._poll, self._shrink, revert_after_s=args.broker_s,
                                   lend=self._lend if variant == "node" else None)
        self.loop = asyncio.new_event_loop()

    async def _poll(self) -> list[EngineMemory]:
        out = []
        for name, core in self.cores.items():
            st = core.status()
            r = st.remap
            lending = None if r is None else Lender(name, st.running, st.waiting,
                                                    r.lendable_layers, r.node_layers)
            out.append(EngineMemory(name, st.running, st.waiting, st.blocks_committed,
                                    lending, r.give_way if r else ""))
        return out

    async def _shrink(self, name: str, pages: int) -> int:
        return self.cores[name].shrink(pages)

    async def _lend(self, name: str, layers: int) -> int:
        remap = self.cores[name].remap
        return remap.lend_to_node(layers) if remap is not None else 0

    def balance(self) -> None:
        self.loop.run_until_complete(self.broker.balance())

    def node_layers(self) -> int:
        return sum(c.remap.node_layers for c in self.cores.values() if c.remap is not None)

    def close(self) -> None:
        for core in self.cores.values():
            core.close()
        for ledger in self.ledgers:
            ledger.close()
        self.loop.close()


def run_trace(models: dict[str, LoadedModel], variant: str, kv_budget: int,
              args: argparse.Namespace, texts: list[str], tmp: Path) -> tuple[Run, int, int]:
    """The busy model's run; the most layers lent to the node; layers left lent after."""
    node = Node(models, variant, kv_budget, args, tmp)
    busy, loaded = node.cores["busy"], models["busy"]
    arrivals = [(b * args.gap_s, f"b{b}r{i}", texts[b * args.burst + i])
                for b in range(args.bursts) for i in range(args.burst)]
    arrived: dict[str, float] = {}
    last: dict[str, float] = {}
    run = Run([], [], {}, 0.0, 0, 0)
    most = 0
    next_round = 0.0
    start = time.perf_counter()
    try:
        while arrivals or busy.has_work():
            now = time.perf_counter() - start
            if now >= next_round:  # the nodemgr's broker, every --broker-s
                node.balance()
                next_round = now + args.broker_s
                most = max(most, node.node_layers())
            while arrivals and arrivals[0][0] <= now:
                _, rid, text = arrivals.pop(0)
                req = GenerateRequest(request_id=rid, prompt=text, sampling=SamplingParams(
                    max_tokens=args.gen, ignore_eos=True))
                busy.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                                 vocab_size=loaded.config.vocab_size,
                                 max_model_len=busy.max_model_len,
                                 fingerprint=loaded.fingerprint))
                arrived[rid] = now
            if not busy.has_work():
                time.sleep(max(0.0, min(arrivals[0][0] - now, args.broker_s))
                           if arrivals else 0.0)
                continue
            for ev in busy.step():
                t = time.perf_counter() - start
                if isinstance(ev, Failure):
                    run.failed += 1
                    continue
                if not ev.token_ids:
                    continue
                rid = ev.request_id
                (run.tbt if rid in last else run.ttft).append(t - last.get(rid, arrived[rid]))
                last[rid] = t
                run.tokens.setdefault(rid, []).extend(ev.token_ids)
            if busy.remap is not None:
                run.max_alpha = max(run.max_alpha, busy.remap.target.alpha)
        run.seconds = time.perf_counter() - start
        for _ in range(3):  # the burst is over: the broker's next rounds revert
            time.sleep(args.broker_s)
            if busy.remap is not None:
                busy.remap.settle()
            node.balance()
        return run, most, node.node_layers()
    finally:
        node.close()


def main(argv: list[str] | None = None) -> None:
    ap = burst_parser(__doc__.splitlines()[0], gen=48)
    ap.add_argument("--broker-s", type=float, default=0.1)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: load_model(write_demo_model(Path(tmp) / name, size=args.size,
                                                    seed=seed), dtype=getattr(torch, args.dtype))
                  for name, seed in (("busy", 1), ("idle", 2))}
        loaded = models["busy"]
        texts = prompts(args.bursts * args.burst, args.prompt_words, args.seed)
        mc = loaded.config
        longest = max(len(loaded.tokenizer.encode_prompt(t)) for t in texts) + args.gen + 1
        one = mc.num_layers * -(-longest // 16) * block_bytes(16, mc.num_kv_heads, mc.head_dim,
                                                             loaded.dtype.itemsize)
        kv_budget = max(int(args.budget_frac * args.burst * one), 2 * one)
        print(f"two {args.size} models ({args.dtype}, {mc.num_layers} layers) on one budget, "
              f"{args.reps} reps, {args.bursts} bursts of {args.burst} x {args.prompt_words} "
              f"words + {args.gen} tokens on one of them; KV room {kv_budget / 2**20:.2f} MiB "
              f"(a burst needs {args.burst * one / 2**20:.2f}), a layer "
              f"{layer_bytes(loaded.model.decoder_layers[0]) / 2**20:.2f} MiB")
        rng = random.Random(args.seed)
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        lent: dict[str, list[int]] = {v: [] for v in VARIANTS}
        left = 0
        run_trace(models, "off", kv_budget, args, texts, Path(tmp))  # (warm-up, not counted)
        for _ in range(args.reps):
            for v in rng.sample(VARIANTS, len(VARIANTS)):
                run, most, after = run_trace(models, v, kv_budget, args, texts, Path(tmp))
                runs[v].append(run)
                lent[v].append(most)
                left += after
    same = all(r.tokens == runs["off"][i].tokens for v in VARIANTS
               for i, r in enumerate(runs[v]))
    print("| variant | p99 TTFT s | p99 TBT s | tok/s | own α max | node layers max | failed "
          "| p99 TTFT vs off (lower better) | tok/s vs off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    med = statistics.median
    for v in VARIANTS:
        rs, base = runs[v], runs["off"]
        ttft = [r.p99(r.ttft) / max(1e-9, b.p99(b.ttft)) for r, b in zip(rs, base, strict=True)]
        tput = [r.throughput / b.throughput for r, b in zip(rs, base, strict=True)]
        print(f"| {v} | {med(r.p99(r.ttft) for r in rs):.3f} | "
              f"{med(r.p99(r.tbt) for r in rs):.4f} | {med(r.throughput for r in rs):.1f} | "
              f"{max(r.max_alpha for r in rs)} | {max(lent[v])} | "
              f"{sum(r.failed for r in rs)} | {interval(ttft)} | {interval(tput)} |")
    print(f"layers left lent to the node after the trace: {left}")
    print(f"busy model's tokens equal to off's in every variant: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
