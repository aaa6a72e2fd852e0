"""Where does Overture beat sticky sessions and prefix-aware routing? A map on the
simulator (which runs the real policy, registry and block-allocator code), issue #42.

    python -m bench.sim.map [--calibration FILE] [--nodes 2] [--seeds 3] [--out DIR]
                            [--quick]

Four axes, around a base point (the evaluation's quick workload on the calibrated 2-node
CPU cluster):

- ``sessions``: active sessions per node (users per node; each runs one session);
- ``sigma``: session-length variance (the lognormal spread of turn lengths; ShareGPT's
  heavy tail is 1.0) and, as its own workload, agent sessions of 10-40 turns with large
  inputs and small outputs;
- ``pressure``: the share of the active sessions' KV the device holds (0.25: a quarter);
- ``cv``: burstiness, the Gamma coefficient of variation of session arrivals.

First each axis alone (one at a time, the others at the base), for each workload; the two
axes along which balanced/sticky moves most are "the most telling"; then the full grid of
those two, heat maps of balanced/sticky and balanced/prefix (mean normalized latency of
the baseline over Overture's, paired over ``--seeds`` traces, with 95% intervals). The
cells where each gain is largest are the points to run on the real cluster; the report
prints their ``bench.eval.run`` commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.eval.stats import Interval, paired_ratio
from bench.sim.cluster import simulate
from bench.sim.costs import Calibration
from bench.workloads.replay import summary
from bench.workloads.trace import build_trace
from services.scheduler.routing.policy import MOVE_TOKENS

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
POLICIES = ("recompute", "sticky", "prefix", "balanced")
FLOOR_TOKENS = 2048  # the least device KV a point gets, in tokens (the eval's 48 MiB)


@dataclass(frozen=True)
class Point:
    """One workload and cluster configuration (what the evaluation's profile sets)."""

    workload: str = "sharegpt"
    sessions: int = 8  # active sessions per node
    sigma: float = 1.0
    pressure: float = 0.25  # share of the active sessions' KV the device holds
    cv: float = 2.0
    # The quick profile's trace (bench/eval/profiles.py), so a point runs on the cluster.
    max_user: int = 160
    max_answer: int = 40
    mean_gap_s: float = 4.0
    time_scale: float = 0.03

    def mean_session_tokens(self) -> float:
        """Mean tokens of a session's KV by its end (capped lognormal means, estimated)."""
        if self.workload == "agent":
            return 25 * (min(1500, self.max_user * 0.8) + min(60, self.max_answer * 0.5))
        return 3.5 * (min(200, self.max_user * 0.55) + min(430, self.max_answer * 0.7))

    def device_kv_bytes(self, cal: Calibration) -> int:
        """Device memory for KV per node: ``pressure`` of its active sessions' KV."""
        need = self.sessions * self.mean_session_tokens() * cal.kv_bytes_per_token
        # (at least FLOOR_TOKENS: a long session's turn must fit while it runs)
        return max(FLOOR_TOKENS * cal.kv_bytes_per_token, int(self.pressure * need))


AXES: dict[str, tuple[float, ...]] = {
    "sessions": (2, 4, 8, 12),
    "sigma": (0.5, 1.0, 1.5),
    "pressure": (0.1, 0.25, 0.5, 1.0),
    "cv": (1.0, 2.0, 4.0),
}
QUICK_AXES: dict[str, tuple[float, ...]] = {
    "sessions": (2, 8), "sigma": (0.5, 1.5), "pressure": (0.1, 1.0), "cv": (1.0, 4.0),
}


def normalized(point: Point, policy: str, nodes: int, cal: Calibration, seed: int,
               move_tokens: int = MOVE_TOKENS) -> float:
    """Mean normalized latency (s/token) of one simulated replay (``move_tokens``: the
    balanced family's locality margin)."""
    users = int(point.sessions * nodes)
    trace = build_trace(users=users, sessions_per_user=1, seed=seed,
                        mean_gap_s=point.mean_gap_s, cv=point.cv, max_user=point.max_user,
                        max_answer=point.max_answer, workload=point.workload,
                        sigma=point.sigma)
    # The longest session must fit on a device while it runs (the simulated engine, like
    # the real one, cannot run a request larger than its KV memory).
    longest = max(sum(t.user_tokens + min(t.answer_tokens, point.max_answer)
                      for t in s.turns) for s in trace.sessions)
    device = max(point.device_kv_bytes(cal), (longest + 64) * cal.kv_bytes_per_token)
    c = dataclasses.replace(cal, device_kv_bytes=device)
    out = simulate(trace, policy=policy, nodes=nodes, calibration=c,
                   time_scale=point.time_scale, max_answer_tokens=point.max_answer,
                   move_tokens=move_tokens)
    return float(summary(out.results).get("normalized_latency_s", 0.0))


@dataclass
class Cell:
    point: Point
    latency: dict[str, list[float]]  # policy -> per seed

    def gain(self, baseline: str) -> Interval:
        """baseline / balanced, paired by seed."""
        return paired_ratio(self.latency[baseline], self.latency["balanced"])


def evaluate(point: Point, nodes: int, cal: Calibration, seeds: int) -> Cell:
    return Cell(point, {p: [normalized(point, p, nodes, cal, s) for s in range(1, seeds + 1)]
                        for p in POLICIES})


def one_at_a_time(base: Point, axes: dict[str, tuple[float, ...]], nodes: int,
                  cal: Calibration, seeds: int) -> dict[str, list[Cell]]:
    out: dict[str, list[Cell]] = {}
    for axis, values in axes.items():
        out[axis] = [evaluate(dataclasses.replace(base, **{axis: type(getattr(base, axis))(v)}),
                              nodes, cal, seeds) for v in values]
        print(f"  {base.workload} {axis}: done", file=sys.stderr, flush=True)
    return out


def telling(sweeps: dict[str, list[Cell]]) -> list[str]:
    """Axes ordered by how far balanced/sticky moves along them (max − min of the mean)."""
    spread = {a: max(c.gain("sticky").mean for c in cells) - min(c.gain("sticky").mean
                                                                   for c in cells)
              for a, cells in sweeps.items()}
    return sorted(spread, key=lambda a: -spread[a])


def grid(base: Point, ax1: str, ax2: str, axes: dict[str, tuple[float, ...]], nodes: int,
         cal: Calibration, seeds: int) -> list[Cell]:
    cells = []
    for v1, v2 in itertools.product(axes[ax1], axes[ax2]):
        p = dataclasses.replace(base, **{ax1: type(getattr(base, ax1))(v1),
                                         ax2: type(getattr(base, ax2))(v2)})
        cells.append(evaluate(p, nodes, cal, seeds))
    return cells


def heatmaps(cells: list[Cell], ax1: str, ax2: str, axes: dict[str, tuple[float, ...]],
             path: Path, title: str) -> None:
    xs, ys = axes[ax2], axes[ax1]
    fig, panes = plt.subplots(1, 2, figsize=(11, 4))
    for pane, baseline in zip(panes, ("sticky", "prefix"), strict=True):
        grid_v = [[next(c.gain(baseline).mean for c in cells
                        if getattr(c.point, ax1) == y and getattr(c.point, ax2) == x)
                   for x in xs] for y in ys]
        im = pane.imshow(grid_v, origin="lower", cmap="RdYlGn", vmin=0.5, vmax=2.5,
                         aspect="auto")
        for i, row in enumerate(grid_v):
            for j, v in enumerate(row):
                pane.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        pane.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
        pane.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
        pane.set_xlabel(ax2)
        pane.set_ylabel(ax1)
        pane.set_title(f"{title}: {baseline} / balanced")
        fig.colorbar(im, ax=pane)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command(point: Point, nodes: int, cal: Calibration) -> str:
    """The ``bench.eval.run`` command that runs ``point`` on the real cluster."""
    mib = point.device_kv_bytes(cal) >> 20
    return (f"python -m bench.eval.run --profile load --variants recompute sticky prefix "
            f"balanced "
            f"--users {int(point.sessions * nodes)} --workload {point.workload} "
            f"--sigma {point.sigma:g} --cv {point.cv:g} --device-mib {max(1, mib)}")


def _cells_table(cells: list[Cell], label: str) -> list[str]:
    lines = [f"| {label} | recompute / balanced | sticky / balanced | prefix / balanced | "
             "balanced ms/token |", "| --- | --- | --- | --- | --- |"]
    for c in cells:
        bal = sum(c.latency["balanced"]) / len(c.latency["balanced"]) * 1000
        lines.append(f"| {c.point.workload}, sessions/node {c.point.sessions:g}, sigma "
                     f"{c.point.sigma:g}, pressure {c.point.pressure:g}, cv {c.point.cv:g} | "
                     f"{c.gain('recompute').fmt(1, 2, '×')} | {c.gain('sticky').fmt(1, 2, '×')} "
                     f"| {c.gain('prefix').fmt(1, 2, '×')} | {bal:.1f} |")
    return lines


def sim_parser(doc: str) -> argparse.ArgumentParser:
    """The options every simulator sweep takes: its calibration, nodes and seeds."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--calibration", default=str(HERE / "calibration-cluster-quick.json"))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = sim_parser(__doc__)
    ap.add_argument("--workloads", nargs="*", default=["sharegpt", "agent"])
    ap.add_argument("--quick", action="store_true", help="two values an axis (a smoke map)")
    ap.add_argument("--out", default=str(RESULTS / f"{time.strftime('%Y-%m-%d')}-map"))
    args = ap.parse_args(argv)
    cal = Calibration.load(Path(args.calibration))
    axes = QUICK_AXES if args.quick else AXES
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    lines = [f"# The map (simulator, {args.nodes} nodes, `{cal.name}`)", "",
             f"Ratios are the baseline's mean normalized latency over balanced's, paired over "
             f"{args.seeds} traces (seeds), with 95% intervals. Reproduce: "
             f"`python -m bench.sim.map{' --quick' if args.quick else ''}`.", ""]
    best: list[tuple[str, Cell]] = []
    for workload in args.workloads:
        base = Point(workload=workload)
        sweeps = one_at_a_time(base, axes, args.nodes, cal, args.seeds)
        order = telling(sweeps)
        lines += [f"## {workload}: each axis alone", ""]
        for axis in axes:
            lines += [*_cells_table(sweeps[axis], axis), ""]
        ax1, ax2 = order[0], order[1]
        cells = grid(base, ax1, ax2, axes, args.nodes, cal, args.seeds)
        png = f"map-{workload}.png"
        heatmaps(cells, ax1, ax2, axes, out / png, workload)
        lines += [f"## {workload}: the two most telling axes, {ax1} × {ax2}", "",
                  f"![heat map]({png})", "", *_cells_table(cells, f"{ax1} × {ax2}"), ""]
        for baseline in ("sticky", "prefix"):
            top = max(cells, key=lambda c, b=baseline: c.gain(b).mean)  # type: ignore[misc]
            best.append((f"{workload}, largest balanced vs {baseline}", top))
    lines += ["## Points for the cluster", "", "| point | sticky / balanced | prefix / "
              "balanced | command |", "| --- | --- | --- | --- |"]
    for what, c in best:
        lines.append(f"| {what} | {c.gain('sticky').fmt(1, 2, '×')} | "
                     f"{c.gain('prefix').fmt(1, 2, '×')} | `{command(c.point, args.nodes, cal)}` |")
    (out / "map.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"[{time.monotonic() - t0:.0f} s] {out / 'map.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
