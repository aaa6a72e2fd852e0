"""The replays of an evaluation run: one per variant and load level, and the advisory
sweeps on ``balanced`` at the highest load; each replays a trace built from the profile and
the run's seed, so that every variant replays the same sessions."""

from __future__ import annotations

import dataclasses

from bench.eval.profiles import BALANCED, Profile, Variant
from bench.workloads.trace import Trace, build_trace


@dataclasses.dataclass(frozen=True)
class Job:
    """One replay: a trace of ``users`` with these advisory knobs on ``variant``."""

    variant: Variant
    users: int
    missed: float = 0.0
    spurious: float = 0.0

    @property
    def tag(self) -> str:
        return f"{self.variant.name}-u{self.users}-m{self.missed:g}-s{self.spurious:g}"


def jobs_of(profile: Profile) -> list[Job]:
    jobs = [Job(v, u) for v in profile.variants for u in profile.users]
    if BALANCED in profile.variants:
        jobs += [Job(BALANCED, profile.high_load, missed=m) for m in profile.missed]
        jobs += [Job(BALANCED, profile.high_load, spurious=s) for s in profile.spurious]
    return jobs


def trace_of(profile: Profile, job: Job, seed: int) -> Trace:
    return build_trace(users=job.users, sessions_per_user=profile.sessions_per_user,
                       seed=seed, mean_gap_s=profile.mean_gap_s, cv=profile.gap_cv,
                       missed=job.missed, spurious=job.spurious,
                       max_user=profile.max_user_tokens, max_answer=profile.max_answer_tokens,
                       workload=profile.workload, sigma=profile.sigma)
