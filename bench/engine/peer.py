"""llama.cpp as the peer of ``bench.engine.speed --peer llama.cpp``: ``llama-bench`` (prefill
and batch-1 decode) and ``llama-batched-bench`` (aggregate decode of N parallel sequences)
on the same GGUF file with the same threads, in the same run.

The binaries are found through ``--llama-cpp-bin DIR`` or ``$OVERTURE_LLAMA_CPP_BIN``
(the folder ``llama-cpp-peer build`` prints; see bench/README.md). Without them the bench
says so and runs the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ENV = "OVERTURE_LLAMA_CPP_BIN"
TOOLS = ("llama-bench", "llama-batched-bench")


def find_bin(flag: str) -> tuple[Path | None, str]:
    """(the folder with both tools, or None, and why not)."""
    where = flag or os.environ.get(ENV, "")
    if not where:
        return None, (f"no llama.cpp: pass --llama-cpp-bin DIR or set {ENV} (build it once "
                      "with ../shared/tools/llama-cpp-peer build)")
    folder = Path(where)
    missing = [t for t in TOOLS if not os.access(folder / t, os.X_OK)]
    if missing:
        return None, f"no llama.cpp in {folder}: {', '.join(missing)} missing"
    return folder, ""


@dataclass(frozen=True)
class PeerResult:
    prefill: dict[int, float]  # prompt tokens -> tok/s (llama-bench)
    decode1: float  # batch-1 decode tok/s (llama-bench)
    batched: dict[int, float]  # parallel sequences -> aggregate decode tok/s


def llama_bench(folder: Path, gguf: Path, threads: int, prompts: list[int],
                gen: int) -> tuple[dict[int, float], float]:
    out = subprocess.run(
        [str(folder / "llama-bench"), "-m", str(gguf), "-t", str(threads),
         "-p", ",".join(map(str, prompts)), "-n", str(gen), "-r", "2", "-o", "json"],
        capture_output=True, text=True, check=True, timeout=3600).stdout
    rows = json.loads(out)
    prefill = {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows if r["n_gen"] == 0}
    decode = next(float(r["avg_ts"]) for r in rows if r["n_prompt"] == 0)
    return prefill, decode


def parse_batched(text: str) -> dict[int, float]:
    """llama-batched-bench's markdown table -> {B: S_TG t/s}."""
    header: list[str] = []
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].isdigit():
            row = dict(zip(header, cells, strict=True))
            out[int(row["B"])] = float(row["S_TG t/s"])
    return out


def batched_bench(folder: Path, gguf: Path, threads: int, prompt: int, gen: int,
                  parallel: list[int]) -> dict[int, float]:
    ctx = max(parallel) * (prompt + gen) + 64
    res = subprocess.run(
        [str(folder / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
         "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
         "-npl", ",".join(map(str, parallel))],
        capture_output=True, text=True, check=True, timeout=3600)
    return parse_batched(res.stdout + res.stderr)


def run_peer(folder: Path, gguf: Path, threads: int, prompts: list[int], gen: int,
             parallel: list[int]) -> PeerResult:
    prefill, decode1 = llama_bench(folder, gguf, threads, prompts, gen)
    return PeerResult(prefill, decode1, batched_bench(folder, gguf, threads, prompts[0], gen,
                                                      parallel))
