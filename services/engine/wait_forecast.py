"""How long a new request would wait for its first step, from the engine's queue and its
measured step times (the admission check that keeps ``max_queue_delay_s``).

A request waits for two things, whichever comes later:

    prefill   every prompt token ahead of it (queued, and running sequences' unfinished
              prompts) is computed first, at most ``token_budget - running`` per step
              (the running sequences' decodes take the rest of each step's budget):

                  wait = tokens × prefill_s_per_token + steps × decode_step_s

    a seat    with ``seats`` all taken, the k-th running sequence to finish frees the
              seat the request needs (k = requests ahead + 1 - free seats), after its
              remaining output tokens, one decode step each:

                  decode_left (ascending)  [3, 9, 40, 200]   k = 2 → 9 steps

Both step costs are measured by the core (``StepCost``); until they are, a cost of zero
predicts no wait from them (the backstop of the queue's oldest request still bounds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.2  # EWMA weight of a new step's sample
MIN_PREFILL_TOKENS = 32  # steps with fewer prompt tokens say little about prefill cost
OUTPUT_SAMPLES = 8  # finished requests before their mean length is trusted


@dataclass(frozen=True)
class QueueShape:
    """The core's queue after a step, as the forecast needs it (taken on the worker)."""

    waiting: int = 0  # sequences in the core's queue
    prefill_tokens: int = 0  # prompt tokens still to compute, queued and running
    running: int = 0
    seats: int = 1  # max_num_seqs
    token_budget: int = 1  # max_num_batched_tokens
    decode_left: tuple[int, ...] = ()  # running sequences' expected output left, ascending
    decode_step_s: float = 0.0  # a step of decodes only, as measured
    prefill_s_per_token: float = 0.0  # as measured (or the prior)


def predicted_wait(shape: QueueShape, entering: int = 0, entering_tokens: int = 0) -> float:
    """Seconds until a request arriving now gets its first step, behind the core's queue
    and ``entering`` requests (``entering_tokens`` prompt tokens) on their way to it."""
    tokens = shape.prefill_tokens + entering_tokens
    per_step = max(1, shape.token_budget - shape.running)
    steps = math.ceil(tokens / per_step)
    prefill = tokens * shape.prefill_s_per_token + steps * shape.decode_step_s
    need = shape.waiting + entering + 1 - max(0, shape.seats - shape.running)
    left = shape.decode_left
    if need <= 0 or not left:
        return prefill
    # Past a full turnover of the running sequences, each later seat frees about as late
    # as the longest one did (a coarse bound: those seats are refilled meanwhile).
    rounds, k = divmod(need - 1, len(left))
    seat_steps = left[k] + rounds * left[-1]
    return max(prefill, seat_steps * shape.decode_step_s)


class StepCost:
    """The core's measured step costs: a decode-only step (s), prefill (s per prompt
    token, the decodes of its step taken out), and how long outputs run (tokens)."""

    def __init__(self, prefill_prior_s_per_token: float = 0.0) -> None:
        self.decode_step_s = 0.0
        self.prefill_s_per_token = prefill_prior_s_per_token
        self._prefill_samples = 0
        self.mean_output_tokens = 0.0
        self._outputs = 0

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """One step that computed ``decode_tokens`` decodes and ``prefill_tokens`` prompt
        tokens in ``seconds``."""
        if seconds <= 0:
            return
        if prefill_tokens == 0 and decode_tokens > 0:
            self.decode_step_s = _ewma(self.decode_step_s, seconds, self.decode_step_s == 0)
        elif prefill_tokens >= MIN_PREFILL_TOKENS:
            # A step costs its fixed part (launch, sampling, bookkeeping: what a decode-only
            # step measures) with or without decodes: left in, it would be charged to each
            # prompt token, and a small model's forecast would be several times too long.
            sample = max(0.0, seconds - self.decode_step_s) / prefill_tokens
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, sample,
                                             self._prefill_samples == 0)
            self._prefill_samples += 1

    def finished(self, output_tokens: int) -> None:
        """A request ended after ``output_tokens`` (its length informs ``expected_left``)."""
        self.mean_output_tokens = _ewma(self.mean_output_tokens, float(output_tokens),
                                        self._outputs == 0)
        self._outputs += 1

    def expected_left(self, generated: int, most_left: int) -> int:
        """Output tokens a running request is expected to produce still: at most
        ``most_left`` (its max_tokens), sooner when requests here usually stop earlier
        (a request with no max_tokens may run to the context, but seldom does)."""
        if self._outputs < OUTPUT_SAMPLES:
            return max(1, most_left)
        typical = max(1, round(self.mean_output_tokens) - generated)
        return max(1, min(most_left, typical))


def _ewma(old: float, sample: float, first: bool) -> float:
    return sample if first else (1 - ALPHA) * old + ALPHA * sample
