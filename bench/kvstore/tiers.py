"""Tier throughput vs a raw baseline of the same medium, measured in the same run.

    python -m bench.kvstore.tiers [--quick] [--reps 5] [--budget-s 1] [--max-chunks 0]

For chunks of 64 KiB and 1 MiB (fp16 KV, shape (2, tokens, 8, 64)), sequentially:

- DRAM: ``TieredStore.put`` (encode = one copy into the arena) and ``get`` + copy of the
  tensor out (as a load into the engine pool would) vs ``torch`` clones kept alive (fresh
  memory, like the arena's) and copy_ out of them.
- SSD: ``SsdTier.put`` of sealed blobs and reads of each whole blob into memory with its
  checksum verified, as the store reads an SSD hit (``get_many_checked``: inline when the
  page cache holds it, else on the reading thread) vs one file per chunk written +
  fsync'ed, and read back. Reads are measured twice: one chunk per call, and the 8
  chunks one layer of a 2k-token history spans in one call (how ``LoadIntoPool`` reads)
  vs the same 8 files read back to back. (A pool load reads into the pool's blocks
  instead of a new blob; ``bench.kvstore.resume_ttft`` measures that path end to end.)
- S3: ``S3Tier.put`` / checked read vs raw boto3 put_object / get_object, against the
  same local S3 server (SeaweedFS, as `overture up` runs it; its own overhead dominates
  both; the ratio shows ours adds little).

Prints GB/s and the ratio tier / baseline (goal: >= 0.5 each).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import boto3
import torch

from bench.harness import aws_keys, s3_keys, start_s3_server
from services.kvstore.config import S3Config
from services.kvstore.malloc_tuning import tune_malloc
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store import TieredStore
from services.kvstore.tiers import DramTier, S3Tier, SsdTier
from services.kvstore.tiers.base import Blob, Stored, Tier
from shared.chunk_codec import ChunkCorrupt, ChunkMeta, encode_chunk, verify_chunk
from shared.config import build

HEADS, HEAD_DIM = 8, 64


def chunk_tensor(nbytes: int, seed: int) -> torch.Tensor:
    tokens = nbytes // (2 * HEADS * HEAD_DIM * 2)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, HEADS, HEAD_DIM, generator=g).half()  # (K/V, tokens, heads, dim)


def metas(n: int) -> list[ChunkMeta]:
    return [ChunkMeta("bench", "fp", i % 32, (i.to_bytes(8, "big"),)) for i in range(n)]


MAX_REPS = 50
LAYER_CHUNKS = 8  # chunks of one layer of a 2k-token history (chunk_tokens=256)
Op = Callable[[int], Awaitable[None]]


@dataclass(frozen=True)
class Passes:
    """How much each side is measured: ``reps`` passes at least, and more (up to
    ``MAX_REPS``) while it has been measured for less than ``budget_s`` seconds."""

    reps: int = 5
    budget_s: float = 1.0


async def paired(total: int, base: Op, ours: Op, n: int, passes: Passes
                 ) -> tuple[float, float]:
    """(baseline GB/s, ours GB/s): the best of alternating passes over ``n`` chunks.

    Alternating baseline and tier passes exposes both to the same background load (the
    machine may be shared), and best-of filters out passes that were preempted. Each side
    gets ``passes.reps`` passes, more while it has been measured for less than its budget (as
    ``timeit`` sizes its runs): a DRAM pass of 64 KiB chunks lasts ~30 ms, and five of them
    were often all disturbed on a busy host, while an SSD or S3 pass lasts seconds.
    """
    best_base = best_ours = float("inf")
    spent = [0.0, 0.0]
    reps = 0
    while reps < passes.reps or (min(spent) < passes.budget_s and reps < MAX_REPS):
        reps += 1
        for fn, which in ((base, 0), (ours, 1)):
            t0 = time.perf_counter()
            for i in range(n):
                await fn(i)
            dt = time.perf_counter() - t0
            spent[which] += dt
            if which == 0:
                best_base = min(best_base, dt)
            else:
                best_ours = min(best_ours, dt)
    return gbps(total, best_base), gbps(total, best_ours)


async def measure(
    total: int, n: int, base_put: Op, put: Op, base_get: Op, get: Op, passes: Passes
) -> dict[str, float]:
    bp, p = await paired(total, base_put, put, n, passes)
    bg, g = await paired(total, base_get, get, n, passes)
    return {"base_put": bp, "put": p, "base_get": bg, "get": g}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def bench_dram(size: int, n: int, passes: Passes) -> dict[str, float]:
    src = [chunk_tensor(size, i) for i in range(min(n, 16))]
    dst = torch.empty_like(src[0])
    ms = metas(n)
    total = n * size
    kept: list[torch.Tensor] = []  # the raw medium keeps every copy, as the arena does

    async def base_put(i: int) -> None:
        if i == len(kept):
            kept.append(src[i % len(src)].clone())
        else:  # a later pass replaces the copy, as a put of the same key does in the arena
            kept[i] = src[i % len(src)].clone()

    async def base_get(i: int) -> None:
        dst.copy_(kept[i])

    async with TieredStore([DramTier(4 * total)], KVStoreMetrics()) as store:
        async def put(i: int) -> None:
            await store.put(ms[i], src[i % len(src)])

        async def get(i: int) -> None:
            c = await store.get(ms[i].key)
            assert c is not None
            dst.copy_(c.tensor)

        return await measure(total, n, base_put, put, base_get, get, passes)


def verified_blob(hit: Stored) -> Blob:
    """The whole blob in memory, checksum verified: what the store makes of a hit below
    DRAM before decoding it (the decode into a tensor view is the consumer's work, not
    the medium's, and is left out as the raw baseline has none)."""
    blob = hit.blob()
    verify_chunk(blob)
    return blob


def blob_ops(tier: Tier, blobs: list[bytes]) -> tuple[Op, Op]:
    """put of sealed blob i, and a read verified where the store verifies a hit below DRAM
    (``get_many_checked``)."""

    async def put(i: int) -> None:
        await tier.put(f"k{i}", blobs[i])

    async def get(i: int) -> None:
        (hit,) = await tier.get_many_checked([f"k{i}"], verified_blob)
        assert hit is not None and not isinstance(hit[1], ChunkCorrupt)

    return put, get


async def bench_ssd(size: int, n: int, root: Path, sync: bool, passes: Passes
                    ) -> dict[str, float]:
    blobs = [bytes(encode_chunk(m, chunk_tensor(size, i % 16))) for i, m in enumerate(metas(n))]
    total = sum(len(b) for b in blobs)
    files = root / f"raw-{size}-{sync}"
    files.mkdir()

    async def base_put(i: int) -> None:
        fd = os.open(files / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, blobs[i])
            os.fsync(fd)
        finally:
            os.close(fd)

    async def base_get(i: int) -> None:
        (files / str(i)).read_bytes()

    tier = SsdTier(str(root / f"db-{size}-{sync}"), 4 * total, sync=sync)
    await tier.open()
    try:
        put, get = blob_ops(tier, blobs)

        async def base_get_layer(b: int) -> None:
            for i in range(b * LAYER_CHUNKS, (b + 1) * LAYER_CHUNKS):
                (files / str(i)).read_bytes()

        async def get_layer(b: int) -> None:
            keys = [f"k{i}" for i in range(b * LAYER_CHUNKS, (b + 1) * LAYER_CHUNKS)]
            for hit in await tier.get_many_checked(keys, verified_blob):
                assert hit is not None and not isinstance(hit[1], ChunkCorrupt)

        r = await measure(total, n, base_put, put, base_get, get, passes)
        layers = n // LAYER_CHUNKS
        r["base_get_layer"], r["get_layer"] = await paired(
            layers * LAYER_CHUNKS * len(blobs[0]), base_get_layer, get_layer, layers, passes)
        return r
    finally:
        await tier.close()


async def bench_s3(size: int, n: int, endpoint: str, passes: Passes) -> dict[str, float]:
    blobs = [bytes(encode_chunk(m, chunk_tensor(size, i % 16))) for i, m in enumerate(metas(n))]
    total = sum(len(b) for b in blobs)
    cfg = build(S3Config, {"endpoint_url": endpoint, "bucket": f"bench-{size}",
                           **s3_keys()})
    raw = boto3.client("s3", endpoint_url=endpoint, region_name=cfg.region,
                       **aws_keys())
    raw_bucket = "raw-" + cfg.bucket
    raw.create_bucket(Bucket=raw_bucket)

    async def base_put(i: int) -> None:
        await asyncio.to_thread(raw.put_object, Bucket=raw_bucket, Key=f"k{i}", Body=blobs[i])

    async def base_get(i: int) -> None:
        def read() -> bytes:
            return raw.get_object(Bucket=raw_bucket, Key=f"k{i}")["Body"].read()

        await asyncio.to_thread(read)

    tier = S3Tier(cfg)
    await tier.open()
    try:
        put, get = blob_ops(tier, blobs)

        return await measure(total, n, base_put, put, base_get, get, passes)
    finally:
        await tier.close()


def report(name: str, size: int, r: dict[str, float]) -> list[float]:
    rp, rg = r["put"] / r["base_put"], r["get"] / r["base_get"]
    print(f"{name:<10} {size >> 10:>5} KiB  put {r['put']:7.3f} GB/s vs raw {r['base_put']:7.3f}  "
          f"ratio {rp:5.2f}   get {r['get']:7.3f} GB/s vs raw {r['base_get']:7.3f}  "
          f"ratio {rg:5.2f}")
    return [rp, rg]


async def main_async(quick: bool, passes: Passes, max_chunks: int = 0) -> int:
    sizes = [64 << 10, 1 << 20]
    counts = {64 << 10: 256 if quick else 2048, 1 << 20: 32 if quick else 256}
    s3_counts = {64 << 10: 32 if quick else 128, 1 << 20: 8 if quick else 32}
    if max_chunks:
        counts = {k: min(v, max_chunks) for k, v in counts.items()}
        s3_counts = {k: min(v, max_chunks) for k, v in s3_counts.items()}
    ratios: list[float] = []
    print("tier       chunk    put / get throughput (sequential, one chunk at a time)")
    endpoint, stop = start_s3_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for size in sizes:
                ratios += report("dram", size, await bench_dram(size, counts[size], passes))
                n, root = counts[size], Path(tmp)
                ssd = await bench_ssd(size, n, root, False, passes)
                ratios += report("ssd", size, ssd)
                layer = ssd["get_layer"] / ssd["base_get_layer"]
                print(f"{'':<10} {'':>9}  get_many of a layer ({LAYER_CHUNKS} chunks, the load "
                      f"path) {ssd['get_layer']:7.3f} GB/s vs raw {ssd['base_get_layer']:7.3f}  "
                      f"ratio {layer:5.2f}")
                ratios.append(layer)
                report("ssd(sync)", size, await bench_ssd(size, n // 4, root, True, passes))
                ratios += report("s3", size, await bench_s3(size, s3_counts[size], endpoint,
                                                            passes))
    finally:
        stop()
    worst = min(ratios)
    print(f"worst ratio {worst:.2f} (goal >= 0.5; ssd(sync) is informational: fsync per put)")
    return 0 if worst >= 0.5 else 1


def main(argv: list[str] | None = None) -> int:
    # One intra-op thread for baseline and tier alike: chunk-sized copies gain nothing from
    # fan-out, and on a shared 2-core machine the fan-out makes timings erratic.
    torch.set_num_threads(1)
    tune_malloc()  # as the kvstore process does at start (services/kvstore/malloc_tuning.py)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer chunks (CI smoke run)")
    p.add_argument("--reps", type=int, default=Passes.reps,
                   help=f"passes per side at least [{Passes.reps}]")
    p.add_argument("--budget-s", type=float, default=Passes.budget_s,
                   help="and more passes while a side has been measured for less than this "
                   f"[{Passes.budget_s:g}]")
    p.add_argument("--max-chunks", type=int, default=0,
                   help="at most this many chunks of each size per tier (0: no cap)")
    args = p.parse_args(argv)
    if args.max_chunks and args.max_chunks < 4 * LAYER_CHUNKS:
        p.error(f"--max-chunks must be 0 or at least {4 * LAYER_CHUNKS} (a layer's "
                f"{LAYER_CHUNKS} chunks, and a quarter of them for the fsync'ed puts)")
    return asyncio.run(main_async(args.quick, Passes(args.reps, args.budget_s),
                                  args.max_chunks))


if __name__ == "__main__":
    raise SystemExit(main())
