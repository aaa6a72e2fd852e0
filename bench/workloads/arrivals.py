"""Session arrivals like BurstGPT's: gaps between sessions drawn from a Gamma
distribution with a chosen mean and coefficient of variation (CV 1 is Poisson; BurstGPT
reports bursty traffic, CV above 1)."""

from __future__ import annotations

import random


def gamma_gaps(rng: random.Random, count: int, mean_s: float, cv: float) -> list[float]:
    """``count`` gaps (seconds) with mean ``mean_s`` and coefficient of variation ``cv``:
    shape k = 1 / cv^2, scale = mean * cv^2."""
    if mean_s <= 0 or cv <= 0:
        raise ValueError("mean_s and cv must be positive")
    shape, scale = 1.0 / cv**2, mean_s * cv**2
    return [rng.gammavariate(shape, scale) for _ in range(count)]
