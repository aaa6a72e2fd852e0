"""Model activation in a running engine (Prism §5.2) against starting an engine for it.

    python -m bench.multimodel.activation [--size small] [--dtype bfloat16] [--reps 3]

Three ways to get a model serving, timed until it answers its first token:
- new process: start a fresh engine process with the model (imports, torch, threads,
  pool, weights): what serving a model costs without an engine pool;
- activate, from disk: an engine already running and empty loads the model with its
  weight files dropped from the page cache first (posix_fadvise DONTNEED);
- activate, from host memory: the same with the files in the page cache (the node's weight
  cache keeps them there).
Goal (issue 24): the ``small`` model activates from host memory in under 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.multimodel.page_cache import drop_from_page_cache, read_into_page_cache
from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import write_demo_model

# What a fresh engine process runs (its imports are part of what is timed).
FIRST_TOKEN = """
import asyncio, sys, time
t0 = float(sys.argv[1])
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from bench.multimodel.page_cache import drop_from_page_cache, read_into_page_cache
from services.engine.api_types import GenerateRequest, SamplingParams
async def main():
    cfg = EngineConfig(model_path=sys.argv[2], dtype=sys.argv[3], device_memory_bytes=256 << 20)
    async with AsyncEngine(cfg) as eng:
        async for _ in eng.generate(GenerateRequest(prompt="Hello", sampling=SamplingParams(
                max_tokens=1))):
            pass
        print(time.time() - t0)
asyncio.run(main())
"""


def new_process(model: Path, dtype: str) -> float:
    out = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(time.time()), str(model),
                          dtype], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


async def activations(model: Path, dtype: str, reps: int) -> tuple[list[float], list[float]]:
    cold: list[float] = []
    warm: list[float] = []
    cfg = EngineConfig(model_path="", standby=True, dtype=dtype, device_memory_bytes=256 << 20)
    async with AsyncEngine(cfg) as eng:
        for _ in range(reps):
            for kind, times in (("cold", cold), ("warm", warm)):
                if kind == "cold":
                    drop_from_page_cache(model)
                else:
                    read_into_page_cache(model)
                t0 = time.perf_counter()
                await eng.activate(str(model))
                req = GenerateRequest(prompt="Hello", sampling=SamplingParams(max_tokens=1))
                async for _ in eng.generate(req):
                    pass
                times.append(time.perf_counter() - t0)
                await eng.evict()
    return cold, warm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / f"demo-{args.size}", size=args.size)
        read_into_page_cache(model)
        fresh = [new_process(model, args.dtype) for _ in range(args.reps)]
        cold, warm = asyncio.run(activations(model, args.dtype, args.reps))
    med = statistics.median
    size = sum(f.stat().st_size for f in model.glob("*.safetensors")) if model.exists() else 0
    print(f"{args.size} model ({args.dtype}), {args.reps} reps, median seconds to the first "
          f"token{f' ({size / 2**20:.0f} MiB of weights)' if size else ''}:")
    print(f"  new engine process          {med(fresh):6.2f} s")
    print(f"  activate, from disk         {med(cold):6.2f} s   "
          f"({med(fresh) / med(cold):.1f}x faster than a new process)")
    print(f"  activate, from host memory  {med(warm):6.2f} s   "
          f"({med(fresh) / med(warm):.1f}x faster than a new process)")
    ok = med(warm) < 1.0
    print(f"goal: activation from host memory < 1 s: {med(warm):.2f} s "
          f"{'MET' if ok else 'NOT MET'}")


if __name__ == "__main__":
    main()
