"""What one evaluation run replays: the workload's size and speed, the device budget that
makes memory scarce, which cluster variants run, and the advisory sweeps.

A variant is one cluster configuration (a policy, or Overture with one mechanism switched
off, Symphony §4.5); every variant replays the same traces, so their numbers compare.
The sweeps (missed and spurious advisories, §4.5 Figures 19 and 20) change the trace, not
the cluster: they replay on the ``balanced`` cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

MIB = 1 << 20
# The ``small`` demo model's KV per token (fp32: 2 x 12 layers x 4 KV heads x 64 x 4 B),
# and the tokens in one of the ``prefix`` router's 64-character blocks (its tokenizer
# makes about 3 characters a token of the traces' text).
SMALL_KV_BYTES_PER_TOKEN = 2 * 12 * 4 * 64 * 4
PREFIX_BLOCK_TOKENS = 21


@dataclass(frozen=True)
class Variant:
    name: str
    label: str  # how the report names it
    policy: str = "balanced"
    offload: dict[str, object] = field(default_factory=dict)  # engine.offload overrides

    def config(self, device_memory_bytes: int) -> str:
        """The ``overture up --config`` YAML of this variant."""
        scheduler: dict[str, object] = {"policy": self.policy}
        if self.policy == "prefix":
            # The router's picture of a device: as many prompt blocks as its KV holds.
            scheduler["prefix_index_blocks"] = max(
                1, device_memory_bytes // (SMALL_KV_BYTES_PER_TOKEN * PREFIX_BLOCK_TOKENS))
        return yaml.safe_dump({
            "scheduler": scheduler,
            "engine": {"device_memory_bytes": device_memory_bytes,
                       "offload": {"policy": "cost", **self.offload}},
        }, sort_keys=True)


RECOMPUTE = Variant("recompute", "recompute (vLLM-like)", policy="recompute")
STICKY = Variant("sticky", "sticky (InferCept-like)", policy="sticky")
PREFIX = Variant("prefix", "prefix-aware (llm-d-like)", policy="prefix")
BALANCED = Variant("balanced", "Overture (balanced)")
ABLATIONS = (
    Variant("no-cooperative", "Overture without cooperative memory",
            offload={"cooperative": False}),
    Variant("no-priority-purge", "Overture without later-layers-first purging",
            offload={"purge_order": "sessions"}),
    Variant("no-layerwise", "Overture without layer-wise loading",
            offload={"mode": "whole_prefix"}),
)
POLICIES = (RECOMPUTE, STICKY, PREFIX, BALANCED)


@dataclass(frozen=True)
class Profile:
    name: str
    users: tuple[int, ...]  # active users per load level (Figure 11's x axis)
    sessions_per_user: int
    max_user_tokens: int
    max_answer_tokens: int
    mean_gap_s: float  # between a user's sessions (Gamma, BurstGPT-style)
    gap_cv: float
    time_scale: float  # human times are multiplied by this (0.05: twenty times faster)
    device_memory_bytes: int  # per engine: small enough for memory pressure
    missed: tuple[float, ...]  # sweep on balanced at the highest load (0 is the baseline)
    spurious: tuple[float, ...]
    variants: tuple[Variant, ...] = (*POLICIES, *ABLATIONS)
    model_size: str = "small"  # the random-weight demo model ``overture up`` serves
    warmup_users: int = 2  # an unmeasured replay of this many users first warms a cluster
    reps: int = 3  # repetitions of every replay (variants interleaved): the intervals' n
    workload: str = "sharegpt"  # or "agent" (bench.workloads.sessions.SHAPES)
    sigma: float = 1.0  # lognormal spread of turn lengths (session-length variance)

    @property
    def high_load(self) -> int:
        return max(self.users)


QUICK = Profile(
    name="quick", users=(10,), sessions_per_user=1, max_user_tokens=160,
    max_answer_tokens=40, mean_gap_s=4.0, gap_cv=2.0, time_scale=0.03,
    device_memory_bytes=48 * MIB, missed=(0.1, 1.0), spurious=(0.6,),
)
FULL = Profile(
    name="full", users=(8, 16, 24), sessions_per_user=2, max_user_tokens=256,
    max_answer_tokens=64, mean_gap_s=6.0, gap_cv=2.0, time_scale=0.05,
    device_memory_bytes=64 * MIB, missed=(0.1, 0.3, 0.5, 1.0), spurious=(0.2, 0.4, 0.6),
)
# The policies only, at rising load (Figure 11's x axis), on the quick workload.
LOAD = Profile(
    name="load", users=(10, 20, 30), sessions_per_user=1, max_user_tokens=160,
    max_answer_tokens=40, mean_gap_s=4.0, gap_cv=2.0, time_scale=0.03,
    device_memory_bytes=48 * MIB, missed=(), spurious=(), variants=POLICIES,
)
# A smoke run (tests/bench): Overture alone, two users, short turns, the tiny model.
SMOKE = Profile(
    name="smoke", users=(2,), sessions_per_user=1, max_user_tokens=32, max_answer_tokens=4,
    mean_gap_s=0.5, gap_cv=1.0, time_scale=0.002, device_memory_bytes=48 * MIB, missed=(),
    spurious=(), variants=(BALANCED,), model_size="tiny", warmup_users=0, reps=1,
)
PROFILES = {p.name: p for p in (QUICK, LOAD, FULL, SMOKE)}
