"""The evaluation report: tables of each variant and sweep, the goals of issue #21 as
ratios measured in the same run, and plots shaped like Symphony's Figures 11 (policies
vs load), 15 (per-node load), 17 (ablations), 19 (missed advisories) and 20 (spurious
advisories). Reads only the records ``bench.eval.run`` wrote, so a report can be
rewritten from ``results.json`` alone."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.eval.profiles import ABLATIONS, BALANCED, POLICIES, Profile
from bench.eval.sim_check import SimRow

Record = dict[str, Any]


def _find(records: list[Record], variant: str, users: int, missed: float = 0.0,
          spurious: float = 0.0) -> Record | None:
    for r in records:
        if (r["variant"], r["users"], r["missed"], r["spurious"]) == (
                variant, users, missed, spurious):
            return r
    return None


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def _row(r: Record, first: str) -> str:
    s = r["summary"]
    src = ", ".join(f"{k} {v:g}" for k, v in sorted(r["turns_by_source"].items()))
    return (f"| {first} | {s.get('requests', 0):.0f} ({s.get('retried', 0):.0f}) | "
            f"{s.get('errors', 0):.0f} | "
            f"{_ms(s.get('ttft_mean_s'))} | {_ms(s.get('ttft_p95_s'))} | "
            f"{_ms(s.get('tpot_mean_s'))} | {_ms(s.get('normalized_latency_s'))} | "
            f"{s.get('requests_per_s', 0):.2f} | {r['imbalance']:.2f} | "
            f"{s.get('cached_tokens_mean', 0):.0f} | {src} |")


HEADER = ("| {} | requests (retried after a 429) | errors | TTFT mean ms | TTFT p95 ms | "
          "TPOT mean ms | normalized latency ms/token | requests/s | max/median load | "
          "cached tokens mean | turns by KV source |\n|" + " --- |" * 11)


def _ratio(num: Record | None, den: Record | None, key: str) -> float | None:
    if num is None or den is None:
        return None
    a, b = num["summary"].get(key), den["summary"].get(key)
    return a / b if a and b else None


def _goal(text: str, value: float | None, ok: bool | None, shown: str) -> str:
    verdict = "not measured" if value is None else ("met" if ok else "**missed**")
    return f"| {text} | {shown if value is not None else '–'} | {verdict} |"


def goals(profile: Profile, records: list[Record]) -> list[str]:
    hi = profile.high_load
    bal, rec = _find(records, "balanced", hi), _find(records, "recompute", hi)
    sticky = _find(records, "sticky", hi)
    lines = ["| goal (issue #21, at the highest load) | measured | verdict |",
             "| --- | --- | --- |"]
    r = _ratio(rec, bal, "normalized_latency_s")
    lines.append(_goal("Overture vs recompute: ≥ 2.4× lower mean normalized latency", r,
                       r is not None and r >= 2.4, f"{r:.2f}×" if r else ""))
    r = _ratio(sticky, bal, "normalized_latency_s")
    lines.append(_goal("Overture vs sticky: ≥ 1.6× lower mean normalized latency", r,
                       r is not None and r >= 1.6, f"{r:.2f}×" if r else ""))
    if bal is not None and sticky is not None:
        b, s = bal["imbalance"], sticky["imbalance"]
        lines.append(_goal("max/median node load ≤ 1.2 for Overture, sticky ≥ 2.5", b,
                           b <= 1.2 and s >= 2.5, f"Overture {b:.2f}, sticky {s:.2f}"))
    m10 = _find(records, "balanced", hi, missed=0.1)
    r = _ratio(m10, bal, "normalized_latency_s")
    lines.append(_goal("10% missed advisories cost ≤ 6% latency", r,
                       r is not None and r <= 1.06, f"{(r - 1) * 100:+.1f}%" if r else ""))
    # Throughput per token served (1 / normalized latency): a replay's requests/s is set
    # by its users' reading and typing, and abandoned drafts lengthen their sessions.
    s60 = _find(records, "balanced", hi, spurious=0.6)
    r = _ratio(s60, bal, "normalized_latency_s")
    lines.append(_goal("60% spurious advisories cost ≤ 2.1% throughput (tokens per second "
                       "of latency)", r, r is not None and r <= 1.021,
                       f"{(1 - 1 / r) * 100:+.1f}%" if r else ""))
    return lines


def _plot_policies(profile: Profile, records: list[Record], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    keys = [("tpot_mean_s", "TPOT mean (ms)"), ("ttft_mean_s", "TTFT mean (ms)"),
            ("normalized_latency_s", "normalized latency (ms/token)")]
    one_load = len(profile.users) == 1  # (bars: one point per line says little)
    for ax, (key, title) in zip(axes, keys, strict=True):
        for i, v in enumerate(POLICIES):
            pts = [(u, r["summary"].get(key, 0) * 1000) for u in profile.users
                   if (r := _find(records, v.name, u)) is not None]
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


def _sweep(records: list[Record], hi: int, field: str, values: tuple[float, ...]
           ) -> list[tuple[float, Record]]:
    out = []
    for x in (0.0, *values):
        r = _find(records, "balanced", hi, **{field: x})
        if r is not None:
            out.append((x, r))
    return out


def _plot_sweep(points: list[tuple[float, Record]], key: str, ylabel: str, xlabel: str,
                path: Path, scale: float = 1.0) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot([x * 100 for x, _ in points], [r["summary"].get(key, 0) * scale
                                           for _, r in points], marker="o")
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
             f"{profile.name}`.", "", "## Policies (Figure 11)", "",
             HEADER.format("policy, users")]
    for v in POLICIES:
        for u in profile.users:
            if (r := _find(records, v.name, u)) is not None:
                lines.append(_row(r, f"{v.label}, {u}"))
    lines += ["", "![policies](fig11_policies.png)", "", "![per-node load](fig15_load.png)",
              "", "## Ablations at the highest load (Figure 17)", "", HEADER.format("variant")]
    ablations = [r for v in (BALANCED, *ABLATIONS) if (r := _find(records, v.name, hi))]
    lines += [_row(r, r["label"]) for r in ablations]
    missed = _sweep(records, hi, "missed", profile.missed)
    spurious = _sweep(records, hi, "spurious", profile.spurious)
    lines += ["", "![ablations](fig17_ablations.png)", "",
              "## Missed advisories (Figure 19)", "", HEADER.format("missed")]
    lines += [_row(r, f"{x:.0%}") for x, r in missed]
    lines += ["", "![missed](fig19_missed.png)", "", "## Spurious advisories (Figure 20)", "",
              HEADER.format("spurious")]
    lines += [_row(r, f"{x:.0%}") for x, r in spurious]
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
    _plot_bars([(r["label"].replace("Overture ", ""), r["summary"].get(
        "normalized_latency_s", 0) * 1000) for r in ablations],
        "normalized latency (ms/token)", run_dir / "fig17_ablations.png")
    _plot_sweep(missed, "normalized_latency_s", "normalized latency (ms/token)",
                "missed advisories (%)", run_dir / "fig19_missed.png", 1000)
    _plot_sweep(spurious, "requests_per_s", "requests/s", "spurious advisories (%)",
                run_dir / "fig20_spurious.png")
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
