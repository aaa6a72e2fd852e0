"""The simulator held against the measurement (issue #21): the same traces as a run's
policy replays, simulated with a calibration (``bench/sim``), mean TTFT and TPOT side by
side with the error of each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.eval.jobs import Job, trace_of
from bench.eval.profiles import POLICIES, Profile
from bench.sim.cluster import simulate
from bench.sim.costs import Calibration
from bench.workloads.replay import summary


@dataclass(frozen=True)
class SimRow:
    variant: str
    users: int
    measured_ttft_s: float
    simulated_ttft_s: float
    measured_tpot_s: float
    simulated_tpot_s: float

    @staticmethod
    def _err(sim: float, real: float) -> str:
        return f"{(sim - real) / real * 100:+.0f}%" if real else "–"

    def row(self) -> str:
        return (f"| {self.variant}, {self.users} users | {self.measured_ttft_s * 1000:.0f} | "
                f"{self.simulated_ttft_s * 1000:.0f} | "
                f"{self._err(self.simulated_ttft_s, self.measured_ttft_s)} | "
                f"{self.measured_tpot_s * 1000:.1f} | {self.simulated_tpot_s * 1000:.1f} | "
                f"{self._err(self.simulated_tpot_s, self.measured_tpot_s)} |")


def simulate_jobs(profile: Profile, seed: int, calibration: Path,
                  records: list[dict[str, Any]]) -> list[SimRow]:
    cal = Calibration.load(calibration)
    rows = []
    for v in POLICIES:
        for u in profile.users:
            rec = next((r for r in records if (r["variant"], r["users"], r["missed"],
                                               r["spurious"]) == (v.name, u, 0.0, 0.0)), None)
            if rec is None:
                continue
            trace = trace_of(profile, Job(v, u), seed)
            out = simulate(trace, policy=v.policy, nodes=2, calibration=cal,
                           time_scale=profile.time_scale,
                           max_answer_tokens=profile.max_answer_tokens, seed=seed)
            sim = summary(out.results)
            real = rec["summary"]
            if "ttft_mean_s" not in real or "ttft_mean_s" not in sim:
                continue  # (a replay that served nothing, or an older results.json)
            rows.append(SimRow(v.name, u, real["ttft_mean_s"], sim["ttft_mean_s"],
                               real["tpot_mean_s"], sim["tpot_mean_s"]))
    return rows
