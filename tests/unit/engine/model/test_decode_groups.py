"""Decodes grouped by context length: the split is optimal and covers every sequence."""

from __future__ import annotations

import random

import pytest

from services.engine.model.paged_attention import group_by_length


def _cost(lens: list[int], groups: list[list[int]], call_keys: int) -> int:
    return sum(call_keys + len(g) * max(lens[i] for i in g) for g in groups)


def _partitions(items: list[int]):
    """Every set partition of ``items`` (Bell-number many: small inputs only)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield [*part[:k], [first, *part[k]], *part[k + 1:]]


def test_no_decodes_no_groups() -> None:
    assert group_by_length([]) == []


def test_equal_lengths_share_one_group() -> None:
    assert group_by_length([300] * 6, 256) == [list(range(6))]


def test_one_long_conversation_among_short_ones_is_attended_apart() -> None:
    lens = [300, 2098, 310, 290, 305, 299, 301, 296]
    groups = group_by_length(lens, 256)
    assert [sorted(g) for g in groups] == [[1], [0, 2, 3, 4, 5, 6, 7]]


def test_a_costly_call_keeps_everything_together() -> None:
    assert len(group_by_length([5, 4000, 17], 10**9)) == 1


@pytest.mark.parametrize("seed", range(200))
def test_split_is_optimal_over_every_partition(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    lens = [rng.choice([1, 16, 40, 300, 301, 1000, 2048]) for _ in range(n)]
    call_keys = rng.choice([0, 64, 256, 1000])
    groups = group_by_length(lens, call_keys)
    assert sorted(i for g in groups for i in g) == list(range(n))
    best = min(_cost(lens, p, call_keys) for p in _partitions(list(range(n))))
    assert _cost(lens, groups, call_keys) == best


def _reference_cost(lens: list[int], call_keys: int) -> int:
    """The optimum over contiguous runs of the sorted lengths, by the quadratic DP."""
    s = sorted(lens, reverse=True)
    best = [0] + [None] * len(s)
    for k in range(1, len(s) + 1):
        best[k] = min(best[j] + call_keys + s[j] * (k - j) for j in range(k))
    return best[-1]


@pytest.mark.parametrize("seed", range(60))
def test_split_matches_the_quadratic_optimum_on_large_batches(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(8, 120)
    lens = [rng.randint(1, rng.choice([40, 600, 5000])) for _ in range(n)]
    call_keys = rng.choice([0, 16, 256, 4096])
    groups = group_by_length(lens, call_keys)
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert _cost(lens, groups, call_keys) == _reference_cost(lens, call_keys)
