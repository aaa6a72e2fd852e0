"""A session's next turn with and without an advisory: time to first token by lead time.

    python -m bench.cluster.advisory_ttft [--history 2048] [--reps 3] [--leads 0.25,1,3]
        [--size small] [--no-warmup] [--raw]

The cluster of ``bench.cluster.resume`` (scheduler, two nodes of kvstore + engine + node
manager, SeaweedFS S3, the `small` demo model in fp32). Each sample is a fresh session:
a history of H random tokens sent as one turn on node0 (its KV saved there and, once
settled, durable in S3), then the timed turn — the history plus a 50-token message — on
node1 (node0 drained), where the KV is not:

- recompute          a history never seen before (the baseline of every ratio)
- device             the timed turn on node0 instead: the history is in its device cache
- peer, s3           no advisory: node1 pulls the history from node0's kvstore during
                     the turn, or (node0's copies deleted) from S3
- peer+L, s3+L       ``POST /v1/advisory`` L seconds before the turn: node1's kvstore
                     prefetches the history into its DRAM meanwhile, then node1's engine
                     copies it into free device blocks
- device+L           ``device`` after the same L seconds of quiet: what the advised turn
                     would cost with its history on device all along. An engine idle for
                     a second answers 20-40 ms slower on this 2-core VM (measured with one
                     AsyncEngine: 110-127 ms back to back, 135-154 ms after 1-3 s idle),
                     so ``peer+L`` is compared with both ``device`` and ``device+L``

Goals (issue #19): with an advisory >= 1 s ahead, TTFT within 1.15x of ``device``; with
0.25 s, no worse than without an advisory. Each sample also records where the turn's KV
was (``kv_from``: device_prefetched, device_partial, local, peer, s3, ...).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.cluster.turns import (
    NEW_MESSAGE_TOKENS,
    complete,
    only_in_s3,
    serve_only,
    settled,
    token_range,
)
from bench.harness import Cluster, start_cluster
from services.engine.model import write_demo_model


def _modes(leads: list[float]) -> list[str]:
    out = ["recompute", "device", "peer", "s3"]
    for where in ("device", "peer", "s3"):
        out += [f"{where}+{lead:g}" for lead in leads]
    return out


def _turns(cluster: Cluster) -> dict[str, float]:
    """overture_turns_total by kv_from."""
    out = {}
    for line in cluster.text("/metrics").splitlines():
        if line.startswith('overture_turns_total{kv_from="'):
            label = line.split('"')[1]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


def sample(cluster: Cluster, model: str, mode: str, history: int, vocab: tuple[int, int],
           rng: random.Random, n: int) -> tuple[float, int, str, str]:
    """One timed turn; (seconds, cached tokens, serving node, where its KV was)."""
    session = f"adv-{mode}-{n}-{rng.randrange(1 << 30)}"
    hist = [rng.randrange(*vocab) for _ in range(history)]
    new = [rng.randrange(*vocab) for _ in range(NEW_MESSAGE_TOKENS)]
    where, _, lead = mode.partition("+")
    serve_only(cluster, "node0")
    if mode != "recompute":
        complete(cluster, hist, session)
    settled(cluster, session if mode != "recompute" else "")
    if where == "s3":
        only_in_s3(cluster, session)
    if where != "device":
        serve_only(cluster, "node1")
    if lead and where != "device":
        status, adv = cluster.post("/v1/advisory", {"session_id": session, "model": model,
                                                    "expected_arrival_s": float(lead)})
        if status != 202 or adv.get("node") != "node1":
            raise RuntimeError(f"advisory refused or misplaced: {status} {adv}")
    if lead:
        time.sleep(float(lead))  # the user types; the node prefetches
    before = _turns(cluster)
    seconds, usage, node = complete(cluster, hist + new, session)
    after = _turns(cluster)
    kv_from = next((k for k, v in after.items() if v > before.get(k, 0.0)), "?")
    return seconds, usage["prompt_tokens_details"]["cached_tokens"], node, kv_from


def run(history: int, reps: int, leads: list[float], raw: bool, size: str = "small",
        warmup: bool = True) -> dict[str, float]:
    rng = random.Random(0)
    modes = _modes(leads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / size, size=size, seed=0)
        vocab = token_range(path)
        with start_cluster(Path(tmp) / "cluster", path, nodes=2, s3=True, ssd=True,
                           ready_timeout=600) as cluster:
            for mode in modes if warmup else ():  # every path once
                sample(cluster, cluster.model, mode, 256, vocab, rng, -1)
            times: dict[str, list[float]] = {m: [] for m in modes}
            sources: dict[str, list[str]] = {m: [] for m in modes}
            for rep in range(reps):
                for mode in modes:
                    s, cached, node, kv_from = sample(cluster, cluster.model, mode, history,
                                                      vocab, rng, rep)
                    times[mode].append(s)
                    sources[mode].append(kv_from)
                    if raw:
                        print(f"  {mode:10s} {s * 1000:8.1f} ms  cached {cached:5d}  on {node}"
                              f"  KV {kv_from}")
    for mode in modes:
        print(f"  {mode:10s} KV from: {', '.join(sorted(set(sources[mode])))}")
    return {m: statistics.median(v) for m, v in times.items()}


def report(history: int, leads: list[float], med: dict[str, float], size: str = "small"
           ) -> None:
    base, device = med["recompute"], med["device"]
    print(f"\nhistory {history} + {NEW_MESSAGE_TOKENS} new tokens, {size} model, fp32, two "
          "nodes; median TTFT over HTTP (× = speed-up over recompute; / device = ratio to "
          "the history already on the serving node's device)")
    print("| turn | TTFT | × recompute | / device |")
    print("| --- | --- | --- | --- |")
    for mode, t in med.items():
        print(f"| {mode} | {t * 1000:.0f} ms | {base / t:.1f}× | {t / device:.2f} |")
    for where in ("peer", "s3"):
        for lead in leads:
            t = med[f"{where}+{lead:g}"]
            idle = med[f"device+{lead:g}"]
            if lead >= 1:
                ok = t <= 1.15 * device
                print(f"{where}, advisory {lead:g} s ahead: {t / device:.2f}× device "
                      f"(goal ≤ 1.15: {'met' if ok else 'NOT met'}); {t / idle:.2f}× device "
                      f"after the same {lead:g} s idle")
            else:
                ok = t <= med[where]
                print(f"{where}, advisory {lead:g} s ahead: {t / med[where]:.2f}× no advisory "
                      f"(goal ≤ 1: {'met' if ok else 'NOT met'})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--leads", default="0.25,1,3", help="advisory lead times, seconds")
    p.add_argument("--size", default="small", choices=("tiny", "small"),
                   help="the demo model (tiny: a smoke run; histories up to ~4k tokens)")
    p.add_argument("--no-warmup", action="store_true",
                   help="no warm-up turn per mode (a smoke run: first-touch costs then land "
                   "in the medians)")
    p.add_argument("--raw", action="store_true", help="print every sample")
    args = p.parse_args(argv)
    leads = [float(x) for x in args.leads.split(",") if x.strip()]
    report(args.history, leads, run(args.history, args.reps, leads, args.raw, args.size,
                                    not args.no_warmup), args.size)


if __name__ == "__main__":
    main()
