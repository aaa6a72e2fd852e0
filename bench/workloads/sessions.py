"""Chat sessions shaped like ShareGPT's (Symphony §2, §4).

Published ShareGPT figures: 26.6% of conversations have one turn (73.4% several), about
3.5 turns on average, sessions of about 2.2k tokens with a heavy tail. Reproduced here by:

- turns: 1 with probability 0.266, else 2 + a geometric count whose mean (2.41) makes the
  overall mean 3.5;
- tokens of a user turn and of an answer: lognormal (sigma 1.0, a heavy tail) with means
  200 and 430, so a session averages 3.5 x 630 = 2.2k tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SINGLE_TURN_SHARE = 0.266
MEAN_TURNS = 3.5
MEAN_USER_TOKENS = 200.0
MEAN_ANSWER_TOKENS = 430.0
SIGMA = 1.0
# Multi-turn sessions: 2 + Geometric(p), whose mean (1 - p) / p makes MEAN_TURNS overall.
_EXTRA_TURNS = (MEAN_TURNS - SINGLE_TURN_SHARE) / (1 - SINGLE_TURN_SHARE) - 2
GEOMETRIC_P = 1 / (1 + _EXTRA_TURNS)


@dataclass(frozen=True)
class TurnShape:
    user_tokens: int
    answer_tokens: int


def _lognormal(rng: random.Random, mean: float, low: int, high: int) -> int:
    mu = math.log(mean) - SIGMA**2 / 2
    return max(low, min(high, round(rng.lognormvariate(mu, SIGMA))))


def turn_count(rng: random.Random) -> int:
    if rng.random() < SINGLE_TURN_SHARE:
        return 1
    extra = 0
    while rng.random() > GEOMETRIC_P:
        extra += 1
    return 2 + extra


def session_shape(rng: random.Random, max_user: int = 4096, max_answer: int = 4096
                  ) -> list[TurnShape]:
    """One session: its turns' user and answer lengths in tokens."""
    return [TurnShape(_lognormal(rng, MEAN_USER_TOKENS, 4, max_user),
                      _lognormal(rng, MEAN_ANSWER_TOKENS, 4, max_answer))
            for _ in range(turn_count(rng))]
