"""What a decode step of a tiny model costs, its linears on MKL against oneDNN, in one run.

    python -m bench.engine.step_cost [--rounds 10] [--steps 30]

The multi-model benchmark runs eight engines of the `tiny` demo models on two cores, one
intra-op thread each, and the cores bind: the cost of a step is what it can serve. At those
shapes oneDNN's fixed cost per linear (~40 us) is most of the call, and an engine on one
thread computes its small float32 weights with MKL instead (services/engine/model/linear.py).

For each model and batch size: the same requests (~300-token prompts, greedy) decoding in
two engine cores with the same weights, one with MKL's small GEMMs (as an engine loads it),
one with every linear on oneDNN's packed weights (as before, and as an engine with more
threads runs). Rounds of ``--steps`` steps alternate between the two so that the machine's
drift hits both; the medians over rounds are compared. Both must produce the same tokens
(greedy; checked).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.model import LoadedModel, linear, load_model, write_demo_model
from services.engine.model.demo_corpus import NOUNS
from services.engine.validation import prepare

PAGE = 16 << 10


def _core(loaded: LoadedModel, batch: int, seed: int) -> EngineCore:
    """A core with ``batch`` requests past their prompts, decoding."""
    core = EngineCore(EngineConfig(dtype="float32", device_memory_bytes=1024 * PAGE,
                                   page_bytes=PAGE), loaded)
    rnd = random.Random(seed)
    for i in range(batch):
        words = " ".join(rnd.choice(NOUNS) for _ in range(150))
        req = GenerateRequest(request_id=f"r{i}", prompt=words,
                              sampling=SamplingParams(max_tokens=1000, ignore_eos=True))
        core.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                         vocab_size=loaded.config.vocab_size,
                         max_model_len=core.max_model_len, fingerprint=loaded.fingerprint))
    while core.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                  for s in core.scheduler.running):
        core.step()
    return core


def _steps(core: EngineCore, n: int, tokens: list[int]) -> float:
    """Seconds per step over ``n`` steps; the tokens of request r0 go to ``tokens``."""
    start = time.perf_counter()
    for _ in range(n):
        for ev in core.step():
            if ev.request_id == "r0":
                tokens.extend(ev.token_ids)
    return (time.perf_counter() - start) / n


class MklNotChosen(RuntimeError):
    """This host (or thread count) keeps the model's small weights on oneDNN."""


def measure(path: Path, batch: int, rounds: int, steps: int) -> tuple[float, float]:
    """(ms per step with MKL's small GEMMs, with oneDNN only)."""
    mkl = load_model(path, dtype=torch.float32)
    if not all(lin.on_mkl for lin in mkl.model.linears()):
        raise MklNotChosen("MKL was not chosen for every weight: the engine uses it only on "
                           "one intra-op thread, for shapes this host's MKL computes "
                           "row-invariantly (services/engine/model/linear.py)")
    saved = linear.SMALL_GEMM_ELEMS
    linear.SMALL_GEMM_ELEMS = 0  # the second copy packs every weight for oneDNN
    try:
        onednn = load_model(path, dtype=torch.float32)
    finally:
        linear.SMALL_GEMM_ELEMS = saved
    cores = {"mkl": _core(mkl, batch, 0), "onednn": _core(onednn, batch, 0)}
    times: dict[str, list[float]] = {k: [] for k in cores}
    tokens: dict[str, list[int]] = {k: [] for k in cores}
    for _ in range(rounds):
        for name, core in cores.items():
            times[name].append(_steps(core, steps, tokens[name]))
    for core in cores.values():
        core.close()
    n = min(len(t) for t in tokens.values())
    assert tokens["mkl"][:n] == tokens["onednn"][:n], "greedy tokens differ"
    return (1e3 * statistics.median(times["mkl"]), 1e3 * statistics.median(times["onednn"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batches", default="1,4,8")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each engine of the multi-model benchmark
    print("| model | batch | ms/step, MKL small GEMMs | ms/step, oneDNN only | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for size in ("tiny", "tiny-deep"):
            path = write_demo_model(Path(tmp) / size, size=size, seed=1)
            for batch in (int(b) for b in args.batches.split(",")):
                try:
                    a, b = measure(path, batch, args.rounds, args.steps)
                except MklNotChosen as e:
                    print(f"nothing to compare on this host: {e}")
                    return
                print(f"| {size} | {batch} | {a:.2f} | {b:.2f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
