"""What the Reuse Store counts (for /metrics) and measures: reuse hits and loads,
evictions, packing and compaction with their time, the load bandwidth (b_m of Equation 2
and B of Equation 3), and each model's access frequency (p_m of Equation 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Bandwidth:
    """Bytes per second of weight loads, an exponentially weighted mean (0.0: none yet)."""

    value: float = 0.0
    weight: float = 0.3

    def sample(self, bytes_per_s: float) -> None:
        self.value = bytes_per_s if not self.value else (
            (1 - self.weight) * self.value + self.weight * bytes_per_s)


@dataclass
class StoreStats:
    hits: int = 0  # tensors mapped as they were
    hit_bytes: int = 0
    loads: int = 0  # tensors an engine had to write
    loaded_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    packings: int = 0  # Algorithm 1 runs (the free regions were too fragmented as they were)
    packing_seconds: float = 0.0
    compactions: int = 0
    moved_bytes: int = 0
    compaction_seconds: float = 0.0
    bandwidth: Bandwidth = field(default_factory=Bandwidth)


class AccessFrequency:
    """Each model's share of recent activations, decayed with a half-life: p_m, the
    probability that the next activation is m's, is what evicting m's tensors risks."""

    def __init__(self, half_life_s: float = 600.0) -> None:
        self.half_life_s = half_life_s
        self._score: dict[str, tuple[float, float]] = {}  # model -> (score, at)

    def _decayed(self, model: str, now: float) -> float:
        score, at = self._score.get(model, (0.0, now))
        return score * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def access(self, model: str, now: float) -> None:
        self._score[model] = (self._decayed(model, now) + 1.0, now)

    def share(self, model: str, now: float) -> float:
        total = sum(self._decayed(m, now) for m in self._score)
        return self._decayed(model, now) / total if total else 0.0
