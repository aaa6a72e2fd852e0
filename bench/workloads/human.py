"""How long people take to read an answer and type the next message (Symphony §4, "Trace
Generation": the next turn comes after the user reads the answer and types; the advisory
fires when typing starts).

Reading: 228 words a minute, the IReST norm for adults reading English texts
(Trauzettel-Klosinski et al. 2012, the paper's [42]: 228 +- 30), spread +-15% between users.
Typing: 40 words a minute by default, spread +-25%; the paper takes typing speeds from
Pinet et al. 2022 ([28]), a study of students' typing, without giving the figure it used,
so it is a parameter here. A token is 0.75 words (English text with a BPE tokenizer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS_PER_TOKEN = 0.75
READING_WPM = 228.0
TYPING_WPM = 40.0


@dataclass(frozen=True)
class Human:
    reading_wpm: float
    typing_wpm: float

    @classmethod
    def sample(cls, rng: random.Random, reading_wpm: float = READING_WPM,
               typing_wpm: float = TYPING_WPM) -> Human:
        return cls(reading_wpm * rng.uniform(0.85, 1.15), typing_wpm * rng.uniform(0.75, 1.25))

    def reading_s(self, tokens: int) -> float:
        return tokens * WORDS_PER_TOKEN / self.reading_wpm * 60.0

    def typing_s(self, tokens: int) -> float:
        return tokens * WORDS_PER_TOKEN / self.typing_wpm * 60.0
