"""Prism's Algorithm 1: hand-worked placements, the migration threshold τ, and the bound
on the largest KV pressure against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from services.scheduler.placement import ModelDemand, max_kvpr, place_models

GPUS = {"g0": 10, "g1": 10}


def test_hand_worked_placement() -> None:
    # r/s: A 4, B 3, C 1 (each 2 bytes of weights). A -> g0 (both 0; the first).
    # B: g0 4/8 = 0.5, g1 0/10 -> g1 (3/8). C: g0 0.5, g1 0.375 -> g1.
    models = [ModelDemand("C", 1, 2, 1.0), ModelDemand("A", 4, 2, 1.0),
              ModelDemand("B", 3, 2, 1.0)]
    assert place_models(models, GPUS, tau=0.0) == {"A": "g0", "B": "g1", "C": "g1"}


def test_slo_weights_the_rate() -> None:
    # B has the larger rate but a 4x looser SLO: A (2/0.5 = 4) goes first.
    models = [ModelDemand("A", 2, 2, 0.5), ModelDemand("B", 6, 2, 2.0)]
    assert place_models(models, GPUS, tau=0.0) == {"A": "g0", "B": "g1"}


@pytest.mark.parametrize(("tau", "where"), [(0.2, "g0"), (0.1, "g1")])
def test_tau_keeps_a_model_where_it_runs(tau: float, where: str) -> None:
    # As the hand-worked case, C running on g0: current 0.5, best 0.375, gain 0.125.
    models = [ModelDemand("A", 4, 2, 1.0), ModelDemand("B", 3, 2, 1.0),
              ModelDemand("C", 1, 2, 1.0, current="g0")]
    assert place_models(models, GPUS, tau=tau)["C"] == where


def test_full_nodes_have_infinite_pressure() -> None:
    models = [ModelDemand("big", 1, 10, 1.0), ModelDemand("small", 1, 1, 1.0)]
    assert place_models(models, GPUS, tau=0.0) == {"big": "g0", "small": "g1"}
    assert place_models([], GPUS, tau=0.0) == {} and place_models(models, {}, 0.0) == {}


@pytest.mark.parametrize("seed", range(40))
def test_largest_pressure_is_within_the_bound_of_the_best(seed: int) -> None:
    """Greedy list scheduling: never far above the optimum (here, within 2x plus the
    pressure one model alone adds), and never below it."""
    rnd = random.Random(seed)
    cap = {f"n{i}": 100 for i in range(rnd.randint(2, 3))}
    models = [ModelDemand(f"m{j}", rnd.uniform(0.1, 5), rnd.randint(1, 20),
                          rnd.choice((0.5, 1.0, 2.0))) for j in range(rnd.randint(2, 6))]
    got = max_kvpr(models, cap, place_models(models, cap, tau=0.0))
    best = min(max_kvpr(models, cap, dict(zip((m.name for m in models), nodes, strict=True)))
               for nodes in itertools.product(cap, repeat=len(models)))
    one = max(m.weighted_rate / (100 - m.weight_bytes) for m in models)
    assert best <= got <= 2 * best + one
