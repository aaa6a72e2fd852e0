"""Does a locality margin close balanced's gap to sticky? The simulator (the real policy
code) at one map point, balanced with several ``scheduler.move_tokens`` beside sticky,
paired over seeds (issue #42: on agent sessions balanced was 13% behind sticky).

    python -m bench.sim.margin [--workload agent] [--sessions 8] [--pressure 0.25]
        [--seeds 3] [--move-tokens 0 512 1024 2048] [--nodes 2] [--calibration FILE]

``move_tokens`` 0 is balanced without a margin (load alone decides). For each variant:
mean normalized latency over the seeds with its 95% interval, and sticky over it paired
by seed (above 1: the variant beats sticky; a ratio whose interval holds 1 is no
difference).
"""

from __future__ import annotations

import sys

from bench.eval.stats import mean_interval, paired_ratio
from bench.sim.costs import Calibration
from bench.sim.map import Point, normalized, sim_parser


def run(point: Point, nodes: int, cal: Calibration, seeds: int,
        margins: list[int]) -> dict[str, list[float]]:
    """Normalized latency per seed of sticky and of balanced at each margin."""
    out: dict[str, list[float]] = {"sticky": []}
    for m in margins:
        out[f"balanced, move_tokens {m}"] = []
    for seed in range(1, seeds + 1):  # variants interleaved: seed by seed
        out["sticky"].append(normalized(point, "sticky", nodes, cal, seed))
        for m in margins:
            out[f"balanced, move_tokens {m}"].append(
                normalized(point, "balanced", nodes, cal, seed, move_tokens=m))
        print(f"  seed {seed}: done", file=sys.stderr, flush=True)
    return out


def report(point: Point, got: dict[str, list[float]]) -> list[str]:
    lines = [f"{point.workload}, {point.sessions:g} sessions a node, pressure "
             f"{point.pressure:g}, sigma {point.sigma:g}, cv {point.cv:g}; "
             f"{len(got['sticky'])} seeds",
             "| variant | ms/token | sticky / variant |", "| --- | --- | --- |"]
    for name, values in got.items():
        ratio = "1" if name == "sticky" else paired_ratio(got["sticky"], values).fmt(1, 2, "×")
        lines.append(f"| {name} | {mean_interval(values).fmt(1000, 1)} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = sim_parser(__doc__)
    ap.add_argument("--workload", default="agent", choices=("agent", "sharegpt"))
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--pressure", type=float, default=0.25)
    ap.add_argument("--move-tokens", type=int, nargs="+", default=[0, 512, 1024, 2048])
    ap.add_argument("--max-user", type=int, default=Point.max_user,
                    help="cap on a user turn's tokens (the quick profile's 160)")
    args = ap.parse_args(argv)
    cal = Calibration.load(args.calibration)
    point = Point(workload=args.workload, sessions=args.sessions, pressure=args.pressure,
                  max_user=args.max_user)
    print("\n".join(report(point, run(point, args.nodes, cal, args.seeds,
                                      args.move_tokens))))


if __name__ == "__main__":
    main()
