"""Stage 1 (Tangram §3.2.2, Equation 2) on hand-worked examples."""

from __future__ import annotations

import pytest

from services.nodemgr.reuse_store.eviction import Candidate, choose_evictions, eviction_cost


def test_equation_2() -> None:
    # c = p · (s / b) · α: 0.5 · (100 / 50) · 1 = 1.0; a shared tensor sums its models.
    assert eviction_cost(100, [(0.5, 1.0)], 50.0) == pytest.approx(1.0)
    assert eviction_cost(100, [(0.5, 1.0), (0.25, 2.0)], 50.0) == pytest.approx(2.0)
    assert eviction_cost(100, [], 50.0) == 0.0  # no model wants it: free to evict


def test_cheapest_first_until_the_need_is_met() -> None:
    cands = [Candidate("hot-big", 400, 8.0), Candidate("cold-big", 400, 0.5),
             Candidate("cold-small", 100, 0.5), Candidate("warm", 200, 2.0)]
    # Ties in cost: the larger first (fewer tensors for the same bytes).
    assert [c.key for c in choose_evictions(cands, 450) or []] == ["cold-big", "cold-small"]
    assert [c.key for c in choose_evictions(cands, 600) or []] == [
        "cold-big", "cold-small", "warm"]
    assert choose_evictions(cands, 2000) is None
    assert choose_evictions(cands, 0) == []
