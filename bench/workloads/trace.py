"""A whole evaluation trace: a fixed number of active users, each running chat sessions
one after another; sessions start after Gamma-distributed gaps; in a session every turn
comes after the user read the previous answer and typed the message, and its advisory
fires when the typing starts (Symphony §4).

Knobs: ``missed`` (share of turns whose advisory never comes), ``spurious`` (share of
advisories for a draft the user abandons: no request follows), ``priority`` (share of
sessions with a high priority). Answer lengths are the requests' ``max_tokens`` (the
runner sends ``ignore_eos`` so a random-weight model answers as long as ShareGPT's did),
and the reading time of a turn is that of the answer the user gets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.workloads.arrivals import gamma_gaps
from bench.workloads.human import Human
from bench.workloads.sessions import SHAPES, SIGMA

_VOCABULARY = """the a to of and in is it you that for on with as this be are what how can do
not your my we but if from or at have will an all about more when there which would like
so time make know use one need should think work good new write code data model system
user answer question explain example please help first list then next why does could
also some other each way best"""
WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True)
class Turn:
    advisory_at: float | None  # seconds from the start of the trace (None: missed)
    request_at: float
    user_tokens: int
    answer_tokens: int
    text: str  # the user's message


@dataclass(frozen=True)
class Session:
    session_id: str
    user: int
    priority: int
    turns: tuple[Turn, ...]
    spurious_at: tuple[float, ...] = ()  # advisories of drafts abandoned unsent


@dataclass
class Trace:
    sessions: list[Session] = field(default_factory=list)

    def events(self) -> list[tuple[float, str, Session, int]]:
        """(time, "advise" | "spurious" | "request", session, turn index) in time order.
        (A turn's request waits for the previous answer: the runner adds what it took.)"""
        out: list[tuple[float, str, Session, int]] = []
        for s in self.sessions:
            for i, t in enumerate(s.turns):
                if t.advisory_at is not None:
                    out.append((t.advisory_at, "advise", s, i))
                out.append((t.request_at, "request", s, i))
            out.extend((at, "spurious", s, -1) for at in s.spurious_at)
        return sorted(out, key=lambda e: e[0])


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens * 0.75))))


def build_trace(*, users: int, sessions_per_user: int, seed: int = 0,
                mean_gap_s: float = 10.0, cv: float = 2.0, missed: float = 0.0,
                spurious: float = 0.0, priority: float = 0.0, max_user: int = 1024,
                max_answer: int = 1024, generation_s_per_token: float = 0.0,
                workload: str = "sharegpt", sigma: float = SIGMA) -> Trace:
    """Every user's sessions, with their turns' advisory and request times. A turn's
    request time assumes the previous answer took ``generation_s_per_token`` a token to
    arrive (0: instantly; the runner shifts later turns by what the answers really took).
    ``workload``: ShareGPT-shaped chat sessions or agent sessions (``sessions.SHAPES``);
    ``sigma``: the lognormal spread of their lengths."""
    shape_of = SHAPES[workload]
    rng = random.Random(seed)
    trace = Trace()
    for user in range(users):
        human = Human.sample(rng)
        clock = 0.0
        for k, gap in enumerate(gamma_gaps(rng, sessions_per_user, mean_gap_s, cv)):
            clock += gap
            shape = shape_of(rng, max_user, max_answer, sigma)
            turns, spurious_at = [], []
            answer_ready = clock
            for i, t in enumerate(shape):
                reading = human.reading_s(shape[i - 1].answer_tokens) if i else 0.0
                typing_starts = answer_ready + reading
                if rng.random() < spurious:  # a draft begun and abandoned first
                    spurious_at.append(typing_starts)
                    typing_starts += human.typing_s(min(t.user_tokens, 40))
                advise = None if rng.random() < missed else typing_starts
                request = typing_starts + human.typing_s(t.user_tokens)
                turns.append(Turn(advise, request, t.user_tokens, t.answer_tokens,
                                  _text(rng, t.user_tokens)))
                answer_ready = request + t.answer_tokens * generation_s_per_token
            clock = answer_ready
            trace.sessions.append(Session(f"u{user}-s{k}", user,
                                          1 if rng.random() < priority else 0, tuple(turns),
                                          tuple(spurious_at)))
    return trace
