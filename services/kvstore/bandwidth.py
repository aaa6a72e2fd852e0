"""Measured load bandwidth per tier, for the engine's load-or-recompute choice.

An EWMA of real loads (bytes read from a tier and copied into a pool / seconds taken),
seeded per tier with a conservative guess until the first measurement.
"""

from __future__ import annotations

# Seeds (bytes/s) until a tier is measured: a memcpy-bound DRAM copy, a page-cache or NVMe
# read with a checksum check, an S3 GET over a LAN.
DEFAULT_BYTES_PER_S = {"dram": 5e9, "ssd": 1e9, "s3": 1e8}
_FALLBACK = 1e8
_MIN_SAMPLE_BYTES = 4096  # tinier reads measure Python overhead, not the medium


class TierBandwidth:
    def __init__(self, tiers: list[str], alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._rate = {t: DEFAULT_BYTES_PER_S.get(t, _FALLBACK) for t in tiers}
        self.measured: set[str] = set()

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes < _MIN_SAMPLE_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        if tier not in self.measured:
            self._rate[tier] = sample  # the first real sample replaces the seed
            self.measured.add(tier)
        else:
            self._rate[tier] += self.alpha * (sample - self._rate[tier])

    def snapshot(self) -> dict[str, float]:
        return dict(self._rate)
