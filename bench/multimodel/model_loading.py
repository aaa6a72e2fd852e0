"""Model loading through the node's Reuse Store (Tangram §3.1, §5) against plain loading.

    python -m bench.multimodel.model_loading [--size small] [--reps 5]

Activation time of one model's weights (until the engine holds a model it can compute
with: plan, fill, build; the KV pool and stepping, the same in every variant, left out):
- plain, from disk: ``load_model`` with the weight files dropped from the page cache
  (posix_fadvise DONTNEED): each engine's private copy, as without the store;
- plain, from host memory: the same with the files in the page cache (the node's weight
  cache keeps them there);
- store, 0% / 50% / 100% resident: ``ReuseStore.plan`` then the engine's ``load_mapped``,
  with nothing resident, with a fine-tune sharing half the tensor bytes resident, with
  the model itself resident (activated before, then evicted from its engine).
The files are in the page cache for the store variants: their baseline is plain loading
from host memory. Variants are interleaved in a rotated order in every repetition;
ratios are paired per repetition (bench/eval/stats.py, 95% intervals).
Memory: the arena's committed pages holding four fine-tunes that share half their
tensor bytes, against the sum of four private copies (each plain load's weight bytes).
Goals (issue 46): >= 2x faster at 50% resident, >= 5x at 100%, shared memory <= 0.6x.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.eval.stats import goal_at_least, mean_interval, paired_ratio
from bench.multimodel.page_cache import drop_from_page_cache, read_into_page_cache
from services.engine.model import load_model, write_demo_model
from services.engine.model.arena_layout import ArenaLayouts
from services.engine.model.mapped import StoredTensor, StoredWeights, load_mapped
from services.nodemgr.reuse_store import ModelIndex, ReuseStore, ShmArena, index_model

DTYPE = "float32"  # served dtype: a bf16 checkpoint is converted, as engines do on CPU
VARIANTS = ("disk", "host", "store 0%", "store 50%", "store 100%")


def activate(store: ReuseStore, model: str, path: Path,
             layouts: ArenaLayouts | None = None) -> torch.nn.Module:
    """What a store activation costs: the plan (nodemgr) and the engine's mapped load.
    ``layouts``: the engine's oneDNN layouts, known per weight shape from its first
    activation on (an engine of a pool outlives its models)."""
    plan = store.plan(model)
    stored = StoredWeights(store.arena.path, store.arena.nbytes, store.dtype,
                           tuple(StoredTensor(m.name, m.offset, m.nbytes, m.fill)
                                 for m in plan))
    got = load_mapped(path, stored, torch.float32, layouts=layouts)
    store.committed(model, got.fill_seconds)
    return got.loaded.model


class Bench:
    def __init__(self, models: dict[str, Path], indexes: dict[str, ModelIndex],
                 work: Path) -> None:
        self.models, self.indexes, self.work = models, indexes, work
        self.arena_bytes = sum(i.total_bytes for i in indexes.values()) + (64 << 20)
        self.layouts = ArenaLayouts()  # (the engine's: found in the untimed warm-up)

    def store(self) -> ReuseStore:
        store = ReuseStore(ShmArena(self.arena_bytes, str(self.work)), dtype=DTYPE)
        for idx in self.indexes.values():
            store.add_index(idx)
        return store

    def one(self, variant: str) -> float:
        """Seconds of one activation of m1 in ``variant`` (its set-up untimed)."""
        path = self.models["m1"]
        if variant in ("disk", "host"):
            (drop_from_page_cache if variant == "disk" else read_into_page_cache)(path)
            started = time.perf_counter()
            loaded = load_model(path, dtype=torch.float32)
            seconds = time.perf_counter() - started
            del loaded
            gc.collect()
            return seconds
        read_into_page_cache(path)
        store = self.store()
        try:
            before = {"store 50%": "m2", "store 100%": "m1"}.get(variant)
            if before is not None:
                activate(store, before, self.models[before], self.layouts)
                gc.collect()
                store.deactivated(before)
            started = time.perf_counter()
            model = activate(store, "m1", path, self.layouts)
            seconds = time.perf_counter() - started
            del model
            gc.collect()
            return seconds
        finally:
            store.arena.close()

    def memory(self) -> tuple[int, int, int]:
        """(the four models' tensor bytes in the arena, the arena's committed pages, four
        private copies' bytes: each model's every tensor, as each engine holds it)."""
        store = self.store()
        try:
            for name, path in self.models.items():
                activate(store, name, path, self.layouts)
            gc.collect()
            return (store.resident_bytes(), store.arena.resident_bytes(),
                    sum(i.total_bytes for i in self.indexes.values()))
        finally:
            store.arena.close()


def run(size: str, reps: int, log: Callable[[str], None] = print) -> None:
    with tempfile.TemporaryDirectory(prefix="overture-bench-") as tmp:
        work = Path(tmp)
        models = {f"m{i}": write_demo_model(work / f"m{i}", size, seed=i, base_seed=0,
                                            share=0.5) for i in range(1, 5)}
        indexes = {n: index_model(n, p, DTYPE) for n, p in models.items()}
        shared_frac = 1 - (sum({**indexes["m1"].unique(), **indexes["m2"].unique()}.values())
                           - indexes["m1"].total_bytes) / indexes["m2"].total_bytes
        b = Bench(models, indexes, work)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        b.one("host")  # (untimed warm-up: oneDNN's first calls, the engine's layouts)
        b.one("store 0%")
        for rep in range(reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for v in order:
                times[v].append(b.one(v))
        load = os.getloadavg()[0]
        log(f"{size} model ({DTYPE}, {indexes['m1'].total_bytes >> 20} MiB of weights; "
            f"the fine-tunes share {shared_frac:.0%} of their bytes), {reps} reps, "
            f"load average {load:.1f} on {os.cpu_count()} cores")
        log("| activation | seconds (mean [95% CI]) | vs plain from host memory |")
        log("| --- | --- | --- |")
        for v in VARIANTS:
            ratio = paired_ratio(times["host"], times[v]).fmt(digits=2, unit="x")
            log(f"| {v} | {mean_interval(times[v]).fmt(digits=3)} | {ratio} |")
        r50 = paired_ratio(times["host"], times["store 50%"])
        r100 = paired_ratio(times["host"], times["store 100%"])
        shared, committed, private = b.memory()
        log(f"memory, four models: {shared >> 20} MiB of tensors in the arena "
            f"({committed >> 20} MiB of pages committed), four private copies "
            f"{private >> 20} MiB: {shared / private:.2f}x ({committed / private:.2f}x in "
            "pages)")
        # (memory is one measurement: it does not vary between runs)
        log(f"goals: 50% resident >= 2x: {goal_at_least(r50, 2.0)}; "
            f"100% resident >= 5x: {goal_at_least(r100, 5.0)}; "
            f"shared memory <= 0.6x: {'met' if committed <= 0.6 * private else '**missed**'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--size", default="small", help="demo model size [default: small]")
    ap.add_argument("--reps", type=int, default=5, help="repetitions [default: 5]")
    args = ap.parse_args(argv)
    run(args.size, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
