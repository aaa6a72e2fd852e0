"""A conversation's next turn on a two-node cluster: time to first token by where its KV is.

    python -m bench.cluster.resume [--history 2048] [--reps 3]
        [--modes recompute,device,dram,peer,s3] [--size small] [--no-warmup] [--raw]
        [--kvstore KEY=VALUE ...]

A real cluster as the integration tests start it (``bench.harness``: scheduler, two nodes
of kvstore + engine + node manager, a SeaweedFS S3 server shared by both kvstores), the
`small` demo model in fp32. Each sample is a fresh session: a history of H random tokens
sent as one turn (its KV saved where that turn ran), then the history plus a 50-token
message, timed over HTTP (``/v1/completions``, one output token: the reply is the first
token).
Where the KV of the history is when the timed turn arrives:

- device      the serving node's device prefix cache (the turn before ran there)
- dram        the serving node's kvstore DRAM (device cache dropped)
- peer        the other node's kvstore: the timed turn goes to node1 (node0 drained) and
              node1 pulls the history from node0 layer by layer, overlapped with compute
- s3          only the shared S3 tier (node0's DRAM and SSD copies deleted once durable)
- recompute   nowhere: a history never seen before

Ratios against recompute in the same run. Goals at 2k (issue 17): peer >= 12x recompute
and within 1.3x of the serving node's own DRAM; S3 >= 8x recompute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from bench.cluster.turns import (
    NEW_MESSAGE_TOKENS,
    complete,
    drop_device_cache,
    only_in_s3,
    serve_only,
    settled,
    token_range,
)
from bench.harness import Cluster, start_cluster
from services.engine.model import write_demo_model

MODES = ("recompute", "device", "dram", "peer", "s3")


def sample(cluster: Cluster, mode: str, history: int, vocab: tuple[int, int],
           rng: random.Random, n: int) -> tuple[float, int, str]:
    """One timed turn with the history's KV where ``mode`` says; (s, cached, node)."""
    session = f"{mode}-{n}-{rng.randrange(1 << 30)}"
    hist = [rng.randrange(*vocab) for _ in range(history)]
    new = [rng.randrange(*vocab) for _ in range(NEW_MESSAGE_TOKENS)]
    serve_only(cluster, "node0")
    if mode != "recompute":
        complete(cluster, hist, session)
    settled(cluster, session if mode != "recompute" else "")
    if mode == "dram":
        drop_device_cache(cluster, "node0")
    if mode == "s3":
        only_in_s3(cluster, session)
    if mode in ("peer", "s3", "recompute"):
        serve_only(cluster, "node1")
    seconds, usage, node = complete(cluster, hist + new, session)
    return seconds, usage["prompt_tokens_details"]["cached_tokens"], node


def run(history: int, reps: int, raw: bool, modes: list[str], size: str = "small",
        warmup: bool = True, kvstore: dict[str, object] | None = None) -> dict[str, float]:
    """``kvstore``: flags of both kvstores (e.g. ``s3_range_bytes``: 0 reads an S3 object
    in one GET, to compare with the ranged reads)."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / size, size=size, seed=0)
        vocab = token_range(model)
        with start_cluster(Path(tmp) / "cluster", model, nodes=2, s3=True, ssd=True,
                           ready_timeout=600, kvstore_flags=kvstore) as cluster:
            for mode in modes if warmup else ():  # every path once (first-touch costs)
                sample(cluster, mode, 256, vocab, rng, -1)
            times: dict[str, list[float]] = {m: [] for m in modes}
            for rep in range(reps):
                for mode in modes:
                    s, cached, node = sample(cluster, mode, history, vocab, rng, rep)
                    times[mode].append(s)
                    if raw:
                        print(f"  {mode:9s} {s * 1000:8.1f} ms  cached {cached:5d}  on {node}")
                    expect_cached = mode != "recompute"
                    if expect_cached != (cached > 0):
                        print(f"  warning: {mode} reused {cached} tokens")
    return {m: statistics.median(v) for m, v in times.items()}


def report(history: int, med: dict[str, float], size: str = "small") -> None:
    base = med["recompute"]
    print(f"\nhistory {history} + {NEW_MESSAGE_TOKENS} new tokens, {size} model, fp32, "
          "two nodes; median TTFT over HTTP")
    print("| recompute | device | DRAM | peer | S3 |")
    print("| --- | --- | --- | --- | --- |")
    cells = [f"{base * 1000:.0f} ms"] + [
        f"{med[m] * 1000:.0f} ms ({base / med[m]:.1f}×)" if m in med else "-"
        for m in MODES[1:]]
    print("| " + " | ".join(cells) + " |")
    if "peer" in med:
        x = base / med["peer"]
        print(f"peer {x:.1f}× recompute (goal ≥ 12×: {'met' if x >= 12 else 'NOT met'})")
    if "peer" in med and "dram" in med:
        r = med["peer"] / med["dram"]
        print(f"peer / own DRAM {r:.2f} (goal ≤ 1.3: {'met' if r <= 1.3 else 'NOT met'})")
    if "s3" in med:
        x = base / med["s3"]
        print(f"S3 {x:.1f}× recompute (goal ≥ 8×: {'met' if x >= 8 else 'NOT met'})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--size", default="small", choices=("tiny", "small"),
                   help="the demo model (tiny: a smoke run; histories up to ~4k tokens)")
    p.add_argument("--no-warmup", action="store_true",
                   help="no warm-up turn per mode (a smoke run: first-touch costs then land "
                   "in the medians)")
    p.add_argument("--raw", action="store_true", help="print every sample")
    p.add_argument("--kvstore", nargs="*", default=[], metavar="KEY=VALUE",
                   help="kvstore flags for both nodes, e.g. s3_range_bytes=0")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset (recompute is always measured)")
    args = p.parse_args(argv)
    modes = ["recompute", *(m for m in args.modes.split(",") if m != "recompute")]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    kvstore = {k: int(v) if v.isdigit() else v
               for k, v in (f.split("=", 1) for f in args.kvstore)}
    report(args.history, run(args.history, args.reps, args.raw, modes, args.size,
                             not args.no_warmup, kvstore), args.size)


if __name__ == "__main__":
    main()
