"""Chat sessions shaped like ShareGPT's (Symphony §2, §4).

Published ShareGPT figures: 26.6% of conversations have one turn (73.4% several), about
3.5 turns on average, sessions of about 2.2k tokens with a heavy tail. Reproduced here by:

- turns: 1 with probability 0.266, else 2 + a geometric count whose mean (2.41) makes the
  overall mean 3.5;
- tokens of a user turn and of an answer: lognormal (sigma 1.0, a heavy tail) with means
  200 and 430, so a session averages 3.5 x 630 = 2.2k tokens. ``sigma`` widens or narrows
  the tail (the session-length variance axis of ``bench.sim.map``).

Agent-like sessions (``agent_shape``, issue #42): 10-40 turns, large inputs (tool output
and files: lognormal, mean 1,500 tokens) and small outputs (mean 60 tokens), as MetaGPT's
roles exchange (Symphony §4.4).
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


AGENT_TURNS = (10, 40)
AGENT_USER_TOKENS = 1500.0
AGENT_ANSWER_TOKENS = 60.0


def _lognormal(rng: random.Random, mean: float, low: int, high: int,
               sigma: float = SIGMA) -> int:
    mu = math.log(mean) - sigma**2 / 2
    return max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def turn_count(rng: random.Random) -> int:
    if rng.random() < SINGLE_TURN_SHARE:
        return 1
    extra = 0
    while rng.random() > GEOMETRIC_P:
        extra += 1
    return 2 + extra


def session_shape(rng: random.Random, max_user: int = 4096, max_answer: int = 4096,
                  sigma: float = SIGMA) -> list[TurnShape]:
    """One session: its turns' user and answer lengths in tokens."""
    return [TurnShape(_lognormal(rng, MEAN_USER_TOKENS, 4, max_user, sigma),
                      _lognormal(rng, MEAN_ANSWER_TOKENS, 4, max_answer, sigma))
            for _ in range(turn_count(rng))]


def agent_shape(rng: random.Random, max_user: int = 4096, max_answer: int = 4096,
                sigma: float = SIGMA) -> list[TurnShape]:
    """One agent session: 10-40 turns of large inputs and small outputs."""
    return [TurnShape(_lognormal(rng, AGENT_USER_TOKENS, 16, max_user, sigma),
                      _lognormal(rng, AGENT_ANSWER_TOKENS, 4, max_answer, sigma))
            for _ in range(rng.randint(*AGENT_TURNS))]


SHAPES = {"sharegpt": session_shape, "agent": agent_shape}
