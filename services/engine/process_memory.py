"""What an engine process holds resident beyond its weights and KV pool, and handing back
what a serving engine no longer needs.

An engine's resident set is its weights, its KV pool and the process: Python, torch and
the math libraries it loads, the tokenizer, glibc's heaps. For a small quantized model the
process is most of it (SmolLM2 at q4: ~120 MiB of weights beside ~260 MiB of process;
bench/README.md "Quantized weights", issue 44). Two parts of the process are not needed
once the model is loaded and can be given back:

- the pages of shared libraries touched once at start-up (torch registers thousands of
  operators from code that never runs again; MKL and oneDNN dispatch tables for every
  CPU): they are clean file pages, so ``madvise(MADV_DONTNEED)`` drops them from the
  process and any page that runs again is mapped back from the page cache (a minor fault,
  no disk read while the node keeps the file cached). A mapping with copied-on-write pages
  (``Anonymous`` > 0 in smaps: relocated data) is never touched, so no written byte is
  ever lost;
- glibc's per-thread heaps: each thread that allocates gets an arena of its own (up to
  8 per core), and freed memory in one arena cannot serve another's allocations. The
  engine's threads (the event loop, the model's worker, OpenMP, gRPC) share ``ARENAS``.

``breakdown`` reads ``/proc/self/smaps`` into those parts, for the bench's report.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from shared.libc import drop_mapped_pages, glibc

_M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2  # glibc's default on 2 cores is 16
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")
SMAPS = Path("/proc/self/smaps")


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas (call it before the engine starts its threads: arenas
    already made stay). True if applied (glibc only)."""
    libc = glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, arenas))


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str  # e.g. "r-xp"
    path: str  # "" for anonymous memory, "[heap]", "[stack]", or a file
    rss: int  # bytes resident
    anonymous: int  # bytes of it that are anonymous (copied on write, for a file)


def mappings(smaps: Path = SMAPS) -> list[Mapping]:
    """Every mapping of the process with its resident and anonymous bytes."""
    out: list[Mapping] = []
    head: tuple[int, int, str, str] | None = None
    rss = anon = 0
    for line in smaps.read_text().splitlines():
        m = _HEADER.match(line)
        if m:
            if head is not None:
                out.append(Mapping(*head, rss, anon))
            head = (int(m[1], 16), int(m[2], 16), m[3], m[4].strip())
            rss = anon = 0
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Anonymous:"):
            anon = int(line.split()[1]) * 1024
    if head is not None:
        out.append(Mapping(*head, rss, anon))
    return out


def _is_library(path: str) -> bool:
    name = os.path.basename(path)
    return path.startswith("/") and (".so" in name or name.startswith("python"))


def droppable(m: Mapping) -> bool:
    """A library's mapping whose resident pages are all the file's own: read-only,
    private, nothing copied on write."""
    return (_is_library(m.path) and "w" not in m.perms and m.perms.endswith("p")
            and m.anonymous == 0 and m.rss > 0)


def drop_library_pages(smaps: Path = SMAPS) -> int:
    """Drop the resident pages of every ``droppable`` mapping; the bytes dropped."""
    dropped = 0
    for m in mappings(smaps):
        if droppable(m) and drop_mapped_pages(m.start, m.end - m.start):
            dropped += m.rss
    return dropped


def _part(m: Mapping) -> str:
    name = os.path.basename(m.path)
    if not m.path or m.path == "[heap]":
        return "heap and anonymous"
    if m.path.startswith("["):
        return "other"
    if m.path.startswith(("/dev/shm/", "/memfd:")):
        return "shared memory (KV pool, weight arena)"
    if "torch" in name or "c10" in name:
        return "torch libraries"
    if any(s in name for s in ("mkl", "dnnl", "gomp", "iomp", "openblas")):
        return "math libraries"
    if "tokenizers" in name:
        return "tokenizer library"
    if _is_library(m.path):
        return "python and other libraries"
    if m.path.endswith(".safetensors"):
        return "weight files"
    return "other files"


def breakdown(smaps: Path = SMAPS) -> Counter[str]:
    """Resident bytes by part of the process (the keys of ``_part``)."""
    parts: Counter[str] = Counter()
    for m in mappings(smaps):
        parts[_part(m)] += m.rss
    return parts
