"""Stage 1 of Tangram's two-stage loading heuristic: minimal-cost eviction (§3.2.2).

Evicting resident tensor t'_j costs, if model m needs it again, the time to reload it,
weighted by how likely m is to need it and how much m's users mind (Equation 2):

    c_j = p_m · (s'_j / b_m) · α_m

p_m: model m's tensor miss probability (here: m's share of the node's recent
activations, so a model activated often is expensive to evict), s'_j: the tensor's
size, b_m: the loading bandwidth (measured by the store), α_m: the model's loading-latency
sensitivity (1 unless its catalogue entry says otherwise). A tensor shared by several
models costs the sum over them: evicting it makes each of them reload it.

Greedy, as the paper does: evict in ascending cost until the bytes released meet the need.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A resident tensor that may be evicted (no active model maps it)."""

    key: str
    size: int
    cost: float


def eviction_cost(size: int, models: Iterable[tuple[float, float]], bandwidth: float) -> float:
    """Equation 2 summed over the models holding the tensor, each as (p_m, α_m)."""
    b = bandwidth if bandwidth > 0 else 1.0
    return sum(p * (size / b) * alpha for p, alpha in models)


def choose_evictions(candidates: Sequence[Candidate], need: int) -> list[Candidate] | None:
    """The cheapest tensors first (ties: the larger first, then by key, so that the choice
    is deterministic) until their sizes add up to ``need``; None if all of them do not."""
    if need <= 0:
        return []
    chosen: list[Candidate] = []
    got = 0
    for c in sorted(candidates, key=lambda c: (c.cost, -c.size, c.key)):
        chosen.append(c)
        got += c.size
        if got >= need:
            return chosen
    return None
