"""The evaluation's statistics against values worked by hand (t table: t_{0.975,2} = 4.303)."""

from __future__ import annotations

import math

import pytest

from bench.eval.stats import (
    Interval,
    compare,
    differ,
    goal_at_least,
    goal_at_most,
    mean_interval,
    paired_difference,
    paired_differences,
    paired_ratio,
    t975,
)


def test_mean_interval_of_three():
    # mean 2, s = 1, half-width 4.303 / sqrt(3) = 2.4843
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv.mean == pytest.approx(2.0)
    assert iv.low == pytest.approx(-0.4843, abs=1e-4)
    assert iv.high == pytest.approx(4.4843, abs=1e-4)
    assert iv.n == 3


def test_one_sample_has_no_interval_and_never_differs():
    iv = mean_interval([5.0])
    assert (iv.low, iv.high) == (-math.inf, math.inf)
    assert not differ([5.0], [500.0])
    assert goal_at_least(iv, 1.0) == "inside the noise"


def test_paired_difference_by_hand():
    # differences 1, 2, 2: mean 5/3, s = 0.57735, half = 4.303 * 0.57735 / sqrt(3) = 1.4343
    assert paired_differences([10, 12, 14], [9, 10, 12]) == [1, 2, 2]
    iv = paired_difference([10, 12, 14], [9, 10, 12])
    assert iv.mean == pytest.approx(5 / 3)
    assert iv.low == pytest.approx(0.2323, abs=1e-4)
    assert iv.high == pytest.approx(3.1010, abs=1e-4)


def test_pairing_removes_the_shared_drift():
    # The same +1 gain on top of a large drift between repetitions: unpaired, the means'
    # intervals overlap (no difference); paired, the difference is exactly 1 every time.
    a = [11.0, 21.0, 31.0]
    b = [10.0, 20.0, 30.0]
    assert not differ(a, b)
    iv = paired_difference(a, b)
    assert (iv.low, iv.mean, iv.high) == pytest.approx((1.0, 1.0, 1.0))


def test_paired_ratio_by_hand():
    # ratios 2, 3, 2: mean 2.3333, half-width 1.4343
    iv = paired_ratio([2, 3, 4], [1, 1, 2])
    assert iv.mean == pytest.approx(7 / 3)
    assert iv.low == pytest.approx(0.8990, abs=1e-4)
    assert iv.high == pytest.approx(3.7677, abs=1e-4)
    with pytest.raises(ValueError):
        paired_ratio([1, 2], [1])
    with pytest.raises(ValueError):
        paired_ratio([1], [0])


def test_t_quantiles():
    assert t975(1) == 12.706
    assert t975(2) == 4.303
    assert t975(30) == 2.042
    assert t975(40) == pytest.approx(2.021)
    # between 30 and 40, linear in 1/df: 2.042 - 0.021 * (1/30 - 1/35) / (1/30 - 1/40)
    assert t975(35) == pytest.approx(2.0300, abs=1e-4)
    assert t975(10**9) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_differ_only_when_intervals_separate():
    assert Interval(1.5, 1.0, 2.0, 3).separates(Interval(2.7, 2.5, 3.0, 3))
    assert not Interval(1.5, 1.0, 2.0, 3).separates(Interval(2.2, 1.5, 3.0, 3))
    # means 2 and 3.5, each s = 0.5 over 3: half-width 1.242 -> [0.758, 3.242] overlaps
    assert not differ([1.5, 2.0, 2.5], [3.0, 3.5, 4.0])
    assert compare([1.5, 2.0, 2.5], [3.0, 3.5, 4.0]) == "no difference"
    # s = 0.1: half-width 0.2484 -> [1.75, 2.25] and [3.25, 3.75] separate
    assert differ([1.9, 2.0, 2.1], [3.4, 3.5, 3.6])
    assert compare([1.9, 2.0, 2.1], [3.4, 3.5, 3.6]) == "lower"


def test_goal_verdicts():
    assert goal_at_least(Interval(2.6, 2.45, 2.75, 3), 2.4) == "met"
    assert goal_at_least(Interval(2.3, 2.2, 2.39, 3), 2.4) == "**missed**"
    assert goal_at_least(Interval(2.4, 2.2, 2.6, 3), 2.4) == "inside the noise"
    assert goal_at_most(Interval(0.03, 0.01, 0.05, 3), 0.06) == "met"
    assert goal_at_most(Interval(0.09, 0.07, 0.11, 3), 0.06) == "**missed**"
    assert goal_at_most(Interval(0.05, -0.02, 0.12, 3), 0.06) == "inside the noise"
    assert Interval(0.05, 0.01, 0.09, 3).fmt(100, 1, "%") == "5.0% [1.0, 9.0]"
