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
import signal
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
    notes: tuple[str, ...] = ()  # how a tool had to be run (see REPACK_OFF)


# Run again without llama.cpp's weight repacking when a tool dies of an illegal instruction:
# a build for the host's CPU (GGML_NATIVE) uses AMX tiles for repacked weights, and a
# kernel or container that does not grant the process AMX state kills it at the first tile
# instruction. The plain CPU path then runs, and the report says so.
REPACK_OFF = {"llama-bench": ["--repack", "0"], "llama-batched-bench": ["--no-repack"]}


def _run(folder: Path, tool: str, args: list[str], notes: list[str]) -> tuple[str, str]:
    """The tool's stdout and stderr; ``notes`` gets a line if it had to run again."""
    cmd = [str(folder / tool), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        notes.append(f"{tool}: illegal instruction with weight repacking (AMX not granted "
                     f"here?); run with {' '.join(REPACK_OFF[tool])}")
        res = subprocess.run([*cmd, *REPACK_OFF[tool]], capture_output=True, text=True,
                             timeout=3600)
    if res.returncode:
        raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)
    return res.stdout, res.stderr


def llama_bench(folder: Path, gguf: Path, threads: int, prompts: list[int],
                gen: int, notes: list[str] | None = None) -> tuple[dict[int, float], float]:
    args = ["-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, prompts)),
            "-n", str(gen), "-r", "2", "-o", "json"]
    rows = json.loads(_run(folder, "llama-bench", args, [] if notes is None else notes)[0])
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
                  parallel: list[int], notes: list[str] | None = None) -> dict[int, float]:
    ctx = max(parallel) * (prompt + gen) + 64
    args = ["-m", str(gguf), "-t", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512",
            "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(map(str, parallel))]
    out, err = _run(folder, "llama-batched-bench", args, [] if notes is None else notes)
    return parse_batched(out + err)


def run_peer(folder: Path, gguf: Path, threads: int, prompts: list[int], gen: int,
             parallel: list[int]) -> PeerResult:
    notes: list[str] = []
    prefill, decode1 = llama_bench(folder, gguf, threads, prompts, gen, notes)
    batched = batched_bench(folder, gguf, threads, prompts[0], gen, parallel, notes)
    return PeerResult(prefill, decode1, batched, tuple(notes))
