"""Each model's request rate, as the placement (Prism Algorithm 1's r_j) needs it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class ModelRates:
    """Requests per second per model, decayed exponentially (``half_life_s``)."""

    def __init__(self, half_life_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._decay = math.log(2) / half_life_s
        self._clock = clock
        self._value: dict[str, tuple[float, float]] = {}  # model -> (rate, at)

    def record(self, model: str) -> None:
        now = self._clock()
        rate, at = self._value.get(model, (0.0, now))
        self._value[model] = (rate * math.exp(-self._decay * (now - at)) + self._decay, now)

    def rate(self, model: str) -> float:
        rate, at = self._value.get(model, (0.0, self._clock()))
        return rate * math.exp(-self._decay * (self._clock() - at))
