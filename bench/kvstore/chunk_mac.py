"""What the keyed MAC of chunks costs: raw MAC throughput and a whole chunk's verify.

    python -m bench.kvstore.chunk_mac [--quick] [--reps 7]

For payloads of 64 KiB and 1 MiB (a chunk of fp16 KV is 64 KiB to a few MiB), the
candidates interleaved in every repetition, on one core:

- ``xxh3-64``: the unkeyed checksum chunks carried before (format 2), the baseline;
- ``hmac-sha256``: what ``shared/chunk_mac`` uses (SHA extensions where the CPU has them);
- ``blake2b-128 keyed`` and ``blake2s-128 keyed``: the other keyed hashes hashlib has;
- ``verify_chunk``: the whole check a read from SSD, S3 or a peer runs (header parse,
  identity, HMAC), on a sealed chunk of that size.

Prints GB/s as the median over repetitions with their min-max spread, and the ratio to
xxh3-64 (how many times slower a tier read's checksum became).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time
from collections.abc import Callable

import torch
import xxhash

from shared.chunk_codec import ChunkMeta, encode_chunk, verify_chunk

KEY = os.urandom(32)


def _candidates(blob: bytes, chunk: bytearray, key: str) -> dict[str, Callable[[], object]]:
    return {
        "xxh3-64": lambda: xxhash.xxh3_64_intdigest(blob),
        "hmac-sha256": lambda: hmac.digest(KEY, blob, "sha256"),
        "blake2b-128 keyed": lambda: hashlib.blake2b(blob, key=KEY, digest_size=16).digest(),
        "blake2s-128 keyed": lambda: hashlib.blake2s(blob, key=KEY, digest_size=16).digest(),
        "verify_chunk": lambda: verify_chunk(chunk, key),
    }


def _rate(fn: Callable[[], object], nbytes: int, budget_s: float) -> float:
    """GB/s of ``fn`` over at least ``budget_s`` (and 3 calls)."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s and n >= 3:
            return n * nbytes / elapsed / 1e9


def _chunk(nbytes: int) -> tuple[bytearray, str]:
    tokens = nbytes // (2 * 8 * 64 * 2)  # (2, tokens, 8 heads, 64 dims) fp16
    meta = ChunkMeta("tenant", "model-fp", 3, (b"\1" * 16,))
    tensor = torch.ones((2, tokens, 8, 64), dtype=torch.float16)
    return encode_chunk(meta, tensor), meta.key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="short budgets (a smoke run)")
    args = ap.parse_args(argv)
    budget = 0.01 if args.quick else 0.2
    print(f"keyed MAC cost, {args.reps} interleaved repetitions, GB/s median [min-max]")
    for kib in (64, 1024):
        chunk, key = _chunk(kib << 10)
        blob = bytes(chunk)
        cands = _candidates(blob, chunk, key)
        rates: dict[str, list[float]] = {name: [] for name in cands}
        for _ in range(args.reps):
            for name, fn in cands.items():
                rates[name].append(_rate(fn, len(blob), budget))
        base = statistics.median(rates["xxh3-64"])
        for name, r in rates.items():
            med = statistics.median(r)
            print(f"{kib:>5} KiB  {name:<18} {med:7.2f} GB/s [{min(r):.2f}-{max(r):.2f}]  "
                  f"{base / med:6.1f} x the time of xxh3-64")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
