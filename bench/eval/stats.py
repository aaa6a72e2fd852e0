"""Statistics for comparisons that hold up on a noisy machine: means with 95% Student-t
intervals, paired differences and ratios (variant A and B replayed the same trace with the
same seed, interleaved, and repeated), and one rule for calling a difference: two results
differ only when their intervals separate.

Why paired: on a shared 2-core machine one replay can be 20% slower than the next for
reasons outside the code. Variants replayed back to back on the same trace share that
drift, so the per-repetition difference (or ratio) cancels much of it; its interval is the
honest spread of the comparison.

A single sample has no interval (it is infinitely wide): it never differs from anything
and never meets a goal. Nothing here needs numpy or scipy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t, t_{0.975, df}: df 1-30 exact to 3 decimals,
# then the usual 40, 60, 120 and infinity rows (linear in 1/df between them).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_T975_TAIL = ((30, 2.042), (40, 2.021), (60, 2.000), (120, 1.980), (math.inf, 1.960))


def t975(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` degrees of freedom (df ≥ 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be ≥ 1, got {df}")
    if df <= 30:
        return _T975[df - 1]
    for (d0, t0), (d1, t1) in itertools.pairwise(_T975_TAIL):
        if d0 <= df <= d1:
            # interpolate in 1/df, the way t tables are meant to be read
            x0, x1, x = 1 / d0, (0.0 if d1 == math.inf else 1 / d1), 1 / df
            return t0 + (t1 - t0) * (x0 - x) / (x0 - x1)
    return 1.960


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% confidence interval over ``n`` samples."""

    mean: float
    low: float
    high: float
    n: int

    def separates(self, other: Interval) -> bool:
        """True when the two intervals do not overlap: the only case called a difference."""
        return self.high < other.low or other.high < self.low

    def above(self, value: float) -> bool:
        """The whole interval is above ``value``."""
        return self.low > value

    def below(self, value: float) -> bool:
        """The whole interval is below ``value``."""
        return self.high < value

    def fmt(self, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
        """``mean [low, high]`` scaled (e.g. 1000 for ms); a single sample shows ± ∞."""
        m = f"{self.mean * scale:.{digits}f}{unit}"
        if self.n < 2:
            return f"{m} (n=1)"
        return f"{m} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"


def mean_interval(xs: Sequence[float]) -> Interval:
    """Mean of ``xs`` with its 95% t-interval: mean ± t975(n-1) · s / √n."""
    n = len(xs)
    if n == 0:
        raise ValueError("no samples")
    mean = math.fsum(xs) / n
    if n == 1:
        return Interval(mean, -math.inf, math.inf, 1)
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    half = t975(n - 1) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n)


def _pairs(a: Sequence[float], b: Sequence[float]) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")


def paired_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] - b[i]`` for each repetition i (same trace and seed in both)."""
    _pairs(a, b)
    return [x - y for x, y in zip(a, b, strict=True)]


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Mean paired difference a − b with its 95% interval (a paired t-test's interval)."""
    return mean_interval(paired_differences(a, b))


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Mean of the per-repetition ratios a[i] / b[i] with its 95% interval: how many
    times a is b, each repetition judged against its own pair."""
    _pairs(a, b)
    if any(y == 0 for y in b):
        raise ValueError("a ratio's denominator is 0")
    return mean_interval([x / y for x, y in zip(a, b, strict=True)])


def differ(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether a and b differ: their means' intervals separate."""
    return mean_interval(a).separates(mean_interval(b))


def compare(a: Sequence[float], b: Sequence[float]) -> str:
    """A word for the comparison of a against b: "lower", "higher" or "no difference"."""
    if not differ(a, b):
        return "no difference"
    return "lower" if math.fsum(a) / len(a) < math.fsum(b) / len(b) else "higher"


def goal_at_least(ratio: Interval, goal: float) -> str:
    """A ratio goal (≥ ``goal``): met when the whole interval is at or above it, missed
    when the whole interval is below it, otherwise undecided within the noise."""
    if ratio.low >= goal:
        return "met"
    if ratio.high < goal:
        return "**missed**"
    return "inside the noise"


def goal_at_most(cost: Interval, goal: float) -> str:
    """A cost goal (≤ ``goal``): met when the whole interval is at or under it."""
    if cost.high <= goal:
        return "met"
    if cost.low > goal:
        return "**missed**"
    return "inside the noise"
