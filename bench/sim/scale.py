"""Symphony's scaling experiments on the simulator: clusters of 8-64 nodes, 256-4096 users.

    python -m bench.sim.scale [--calibration FILE] [--nodes 8 16 32 64]
                              [--users 256 512 1024 2048 4096] [--out DIR] [--quick]

For every (nodes, users) pair it simulates the same ShareGPT-shaped trace under
``recompute`` (vLLM-like), ``sticky`` (InferCept-like) and ``balanced`` (Overture) and
writes ``DIR/scale.md`` (mean TPOT and TTFT, normalized latency, requests/s, load
imbalance: the busiest node's load over the median node's) and two plots:
``fig11-tpot.png`` (TPOT vs users per policy, one panel per cluster size, like Figure 11)
and ``fig15-load.png`` (each node's mean load, sticky vs balanced at the fewest users on
the smallest cluster, like Figure 15).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from bench.sim.cluster import SimOutcome, simulate
from bench.sim.costs import Calibration
from bench.workloads.replay import summary
from bench.workloads.trace import build_trace

HERE = Path(__file__).resolve().parent
POLICIES = ("recompute", "sticky", "balanced")


def imbalance(load: list[tuple[float, dict[str, int]]]) -> dict[str, float]:
    """``peak``: the mean over samples of max / median node load (samples with a median
    of 0 skipped); ``mean``: the busiest node's time-averaged load over the median node's."""
    ratios = []
    for _, by_node in load:
        values = sorted(by_node.values())
        median = statistics.median(values) if values else 0
        if median > 0:
            ratios.append(values[-1] / median)
    per_node = node_means(load)
    med = statistics.median(per_node.values()) if per_node else 0.0
    return {"peak": statistics.mean(ratios) if ratios else 0.0,
            "mean": max(per_node.values()) / med if med > 0 else 0.0}


def node_means(load: list[tuple[float, dict[str, int]]]) -> dict[str, float]:
    """Each node's load (running + waiting) averaged over the samples."""
    if not load:
        return {}
    return {n: statistics.mean(s[n] for _, s in load) for n in load[0][1]}


def run_one(cal: Calibration, policy: str, nodes: int, users: int, args: argparse.Namespace
            ) -> tuple[dict[str, float], SimOutcome]:
    trace = build_trace(users=users, sessions_per_user=args.sessions, seed=args.seed,
                        mean_gap_s=args.mean_gap, max_user=1024, max_answer=args.max_answer)
    out = simulate(trace, policy=policy, nodes=nodes, calibration=cal,
                   time_scale=args.time_scale, max_answer_tokens=args.max_answer)
    row = summary(out.results)
    row.update({f"imbalance_{k}": v for k, v in imbalance(out.load).items()})
    return row, out


def table(rows: list[dict]) -> str:
    head = ("| nodes | users | policy | TPOT ms | TTFT ms | norm. latency ms | req/s "
            "| imbalance max/median (peak) | (time-mean) |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['users']} | {r['policy']} | {r['tpot_mean_s'] * 1e3:.1f} "
            f"| {r['ttft_mean_s'] * 1e3:.0f} | {r['normalized_latency_s'] * 1e3:.1f} "
            f"| {r['requests_per_s']:.2f} | {r['imbalance_peak']:.2f} "
            f"| {r['imbalance_mean']:.2f} |")
    return "\n".join(lines)


def plot_tpot(rows: list[dict], nodes: list[int], path: Path) -> None:
    fig, axes = plt.subplots(1, len(nodes), figsize=(4 * len(nodes), 3.2), squeeze=False)
    for ax, n in zip(axes[0], nodes, strict=True):
        for policy in POLICIES:
            mine = [r for r in rows if r["nodes"] == n and r["policy"] == policy]
            ax.plot([r["users"] for r in mine], [r["tpot_mean_s"] * 1e3 for r in mine],
                    marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{n} nodes")
        ax.set_xlabel("active users")
        ax.set_ylabel("mean TPOT (ms)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load(outcomes: dict[str, SimOutcome], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(outcomes)
    for k, (policy, out) in enumerate(outcomes.items()):
        means = node_means(out.load)
        xs = [i + k * width for i in range(len(means))]
        ax.bar(xs, list(means.values()), width, label=policy)
    ax.set_xlabel("node")
    ax.set_ylabel("mean running + waiting")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default=str(HERE / "calibration-a100-llama8b.json"))
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--users", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--sessions", type=int, default=1, help="sessions per user")
    ap.add_argument("--mean-gap", type=float, default=10.0, help="seconds between sessions")
    ap.add_argument("--max-answer", type=int, default=1024)
    ap.add_argument("--time-scale", type=float, default=0.05,
                    help="human reading and typing times are multiplied by this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="sim-scale")
    ap.add_argument("--quick", action="store_true", help="8 and 16 nodes, 256 and 512 users")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.users = [8, 16], [256, 512]
    cal = Calibration.load(args.calibration)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows: list[dict] = []
    fig15: dict[str, SimOutcome] = {}
    pairs = [(n, u, p) for n in args.nodes for u in args.users for p in POLICIES]
    for n, u, p in tqdm(pairs, desc="simulations", file=sys.stderr):
        row, outcome = run_one(cal, p, n, u, args)
        rows.append({"nodes": n, "users": u, "policy": p, **row})
        if n == min(args.nodes) and u == min(args.users):
            fig15[p] = outcome
    plot_tpot(rows, args.nodes, out_dir / "fig11-tpot.png")
    plot_load(fig15, f"{min(args.users)} users on {min(args.nodes)} nodes",
              out_dir / "fig15-load.png")
    text = (f"# Simulated scaling ({cal.name})\n\nCalibration: {cal.source}.\n"
            f"Trace: {args.sessions} session(s) per user, time scale {args.time_scale:g}, "
            f"answers up to {args.max_answer} tokens, seed {args.seed}. "
            f"{len(pairs)} simulations in {time.monotonic() - t0:.0f} s.\n\n"
            f"{table(rows)}\n\n![TPOT vs users](fig11-tpot.png)\n\n"
            "![per-node load](fig15-load.png)\n")
    (out_dir / "scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
