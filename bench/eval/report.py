"""The evaluation report: tables of each variant and sweep (means with 95% intervals),
the goals of issue #42 as paired ratios with 95% intervals (``compare.py``), and plots
shaped like Symphony's Figures 11 (policies vs load), 15 (per-node load), 17
(ablations), 19 (missed advisories) and 20 (spurious advisories). Reads only the
records ``bench.eval.run`` wrote, so a report can be rewritten from ``results.json``
alone."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.eval.compare import NORM, Record, goals, interval, reps, sweep_rows
from bench.eval.profiles import ABLATIONS, BALANCED, POLICIES, Profile
from bench.eval.sim_check import SimRow
from bench.eval.stats import Interval


def _find(records: list[Record], variant: str, users: int, missed: float = 0.0,
          spurious: float = 0.0) -> Record | None:
    """The first repetition of one configuration (the per-node load plot shows one)."""
    runs = reps(records, variant, users, missed, spurious)
    return runs[min(runs)] if runs else None


def _mean(records: list[Record], variant: str, users: int, key: str) -> float | None:
    iv = interval(reps(records, variant, users), key)
    return None if iv is None else iv.mean


def _iv(runs: dict[int, Record], key: str, scale: float = 1000, digits: int = 0) -> str:
    iv = interval(runs, key)
    return "–" if iv is None else iv.fmt(scale, digits)


def _row(runs: dict[int, Record], first: str) -> str:
    """One configuration's repetitions: totals, and means with their 95% intervals."""
    rs = list(runs.values())
    src: dict[str, float] = {}
    for r in rs:
        for k, v in r["turns_by_source"].items():
            src[k] = src.get(k, 0.0) + v
    total = ", ".join(f"{k} {v:g}" for k, v in sorted(src.items()))
    requests = sum(r["summary"].get("requests", 0) for r in rs)
    retried = sum(r["summary"].get("retried", 0) for r in rs)
    errors = sum(r["summary"].get("errors", 0) for r in rs)
    return (f"| {first} | {len(rs)} | {requests:.0f} ({retried:.0f}) | {errors:.0f} | "
            f"{_iv(runs, 'ttft_mean_s')} | {_iv(runs, 'ttft_p95_s')} | "
            f"{_iv(runs, 'tpot_mean_s', digits=1)} | {_iv(runs, NORM, digits=1)} | "
            f"{_iv(runs, 'requests_per_s', 1, 2)} | {_iv(runs, 'imbalance', 1, 2)} | "
            f"{total} |")


HEADER = ("| {} | runs | requests (retried after a 429) | errors | TTFT mean ms | "
          "TTFT p95 ms | TPOT mean ms | normalized latency ms/token | requests/s | "
          "max/median load | turns by KV source (all runs) |\n|" + " --- |" * 11)
INTERVALS = ("Each cell is the mean over the runs (repetitions on the same traces, variants "
             "interleaved) with its 95% t-interval in brackets; a comparison is called a "
             "difference only when the intervals separate.")


def _tier_rows(records: list[Record], hi: int) -> list[str]:
    """MiB each variant's kvstores moved per replay, by tier and direction (means over the
    runs; scraped from every kvstore's /metrics)."""
    keys = sorted({k for r in records for k in r.get("tier_bytes", {})})
    if not keys:
        return ["(no kvstore metrics were scraped)"]
    out = ["| variant | " + " | ".join(f"{k.split(':')[1]} {k.split(':')[0]} MiB"
                                      for k in keys) + " |", "|" + " --- |" * (len(keys) + 1)]
    for v in (*POLICIES, *ABLATIONS):
        runs = list(reps(records, v.name, hi).values())
        if runs:
            cells = [sum(r.get("tier_bytes", {}).get(k, 0.0) for r in runs) / len(runs)
                     / (1 << 20) for k in keys]
            out.append(f"| {v.label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return out


def _plot_policies(profile: Profile, records: list[Record], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    keys = [("tpot_mean_s", "TPOT mean (ms)"), ("ttft_mean_s", "TTFT mean (ms)"),
            ("normalized_latency_s", "normalized latency (ms/token)")]
    one_load = len(profile.users) == 1  # (bars: one point per line says little)
    for ax, (key, title) in zip(axes, keys, strict=True):
        for i, v in enumerate(POLICIES):
            pts = [(u, m * 1000) for u in profile.users
                   if (m := _mean(records, v.name, u, key)) is not None]
            if pts and one_load:
                ax.bar(i, pts[0][1], label=v.label, color=f"C{i}")
            elif pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=v.label)
        if one_load:
            ax.set_xticks([])
            ax.set_xlabel(f"{profile.users[0]} active users")
        else:
            ax.set_xlabel("active users")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fig11_policies.png", dpi=110)
    plt.close(fig)


def _plot_load(profile: Profile, records: list[Record], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4), sharey=True)
    for ax, name in zip(axes, ("sticky", "balanced"), strict=True):
        r = _find(records, name, profile.high_load)
        if r is None:
            continue
        nodes = sorted({n for _, per in r["load"] for n in per})
        for node in nodes:
            ax.plot([t for t, _ in r["load"]], [per.get(node, 0) for _, per in r["load"]],
                    label=node, lw=1)
        ax.set_title(f"{r['label']}: max/median {r['imbalance']:.2f}")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("running + waiting")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fig15_load.png", dpi=110)
    plt.close(fig)


def _plot_bars(rows: list[tuple[str, float]], ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.bar(range(len(rows)), [v for _, v in rows])
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=15, ha="right",
                  fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep(records: list[Record], hi: int, field: str, values: tuple[float, ...], key: str
           ) -> list[tuple[float, Interval]]:
    """(swept value, the interval of ``key`` over its runs) for each value measured."""
    out = []
    for x in (0.0, *values):
        iv = interval(reps(records, "balanced", hi, **{field: x}), key)
        if iv is not None:
            out.append((x, iv))
    return out


def _plot_sweep(points: list[tuple[float, Interval]], ylabel: str, xlabel: str,
                path: Path, scale: float = 1.0) -> None:
    """The means with their 95% intervals as error bars (a single run: no bar)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    xs = [x * 100 for x, _ in points]
    ys = [iv.mean * scale for _, iv in points]
    err = [[(iv.mean - iv.low) * scale if iv.n > 1 else 0.0 for _, iv in points],
           [(iv.high - iv.mean) * scale if iv.n > 1 else 0.0 for _, iv in points]]
    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dir: Path, profile: Profile, records: list[Record],
                 sim: list[SimRow] | None = None) -> Path:
    hi = profile.high_load
    lines = [f"# Evaluation run `{run_dir.name}` ({profile.name} profile)", "",
             f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores; "
             f"a 2-node `overture up` cluster per variant, the random-weight "
             f"`{profile.model_size}` model "
             f"(fp32), {profile.device_memory_bytes >> 20} MiB of device KV per engine. "
             f"Workload: {', '.join(map(str, profile.users))} active users, "
             f"{profile.sessions_per_user} ShareGPT-shaped session(s) each (user turns ≤ "
             f"{profile.max_user_tokens}, answers ≤ {profile.max_answer_tokens} tokens), "
             f"human reading and typing times × {profile.time_scale:g}. "
             "Reproduce: `python -m bench.eval.run --profile "
             f"{profile.name}`.", "", INTERVALS, "", "## Policies (Figure 11)", "",
             HEADER.format("policy, users")]
    for v in POLICIES:
        for u in profile.users:
            if runs := reps(records, v.name, u):
                lines.append(_row(runs, f"{v.label}, {u}"))
    lines += ["", "Bytes the kvstores moved per replay at the highest load (\"in\": written "
              "into the tier, \"out\": read from it):", "", *_tier_rows(records, hi)]
    lines += ["", "![policies](fig11_policies.png)", "", "![per-node load](fig15_load.png)",
              "", "## Ablations at the highest load (Figure 17)", "", HEADER.format("variant")]
    ablations = [(v.label, runs) for v in (BALANCED, *ABLATIONS)
                 if (runs := reps(records, v.name, hi))]
    lines += [_row(runs, label) for label, runs in ablations]
    lines += ["", "![ablations](fig17_ablations.png)", "",
              "## Missed advisories (Figure 19)", "",
              *sweep_rows(records, hi, "missed", profile.missed)]
    lines += ["", "![missed](fig19_missed.png)", "", "## Spurious advisories (Figure 20)", "",
              *sweep_rows(records, hi, "spurious", profile.spurious)]
    lines += ["", "![spurious](fig20_spurious.png)", "", "## Goals", "",
              *goals(profile, records)]
    if sim:
        lines += ["", "## Simulator against the measurement", "",
                  "| variant | measured TTFT ms | simulated TTFT ms | error | measured TPOT "
                  "ms | simulated TPOT ms | error |", "|" + " --- |" * 7]
        lines += [s.row() for s in sim]
    run_dir.mkdir(parents=True, exist_ok=True)
    _plot_policies(profile, records, run_dir)
    _plot_load(profile, records, run_dir)
    _plot_bars([(label.replace("Overture ", ""), iv.mean * 1000) for label, runs in ablations
                if (iv := interval(runs, NORM)) is not None],
               "normalized latency (ms/token)", run_dir / "fig17_ablations.png")
    _plot_sweep(_sweep(records, hi, "missed", profile.missed, NORM),
                "normalized latency (ms/token)", "missed advisories (%)",
                run_dir / "fig19_missed.png", 1000)
    _plot_sweep(_sweep(records, hi, "spurious", profile.spurious, NORM),
                "normalized latency (ms/token)", "spurious advisories (%)",
                run_dir / "fig20_spurious.png", 1000)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
