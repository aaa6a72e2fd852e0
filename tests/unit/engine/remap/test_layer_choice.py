"""MIRAGE §5.4: streamed layers at uniform intervals, and the one-slot / two-slot scheme
chosen by Equations 4 and 5 on hand-worked per-layer times."""

from __future__ import annotations

import pytest

from services.engine.remap import (
    choose_slots,
    double_buffer_fits,
    max_alpha,
    plan_layers,
    single_slot_fits,
    uniform_layers,
)


def test_layers_are_chosen_at_uniform_intervals_around_the_circle() -> None:
    assert uniform_layers(8, 2) == (0, 4)  # the paper's example: layers 1 and 5 of 8
    assert uniform_layers(8, 4) == (0, 2, 4, 6)
    assert uniform_layers(40, 10) == tuple(range(0, 40, 4))
    layers = uniform_layers(8, 3)  # gaps (circular) differ by at most one layer
    gaps = [(b - a) % 8 for a, b in zip(layers, (*layers[1:], layers[0] + 8), strict=True)]
    assert sorted(gaps) == [2, 3, 3]
    with pytest.raises(ValueError):
        uniform_layers(4, 5)


def test_equation_4_and_5_on_hand_worked_times() -> None:
    # n = 8, α = 1, one slot: T_T (α+1) <= T_c (n-α-1)  ->  2 T_T <= 6 T_c
    assert single_slot_fits(1, 8, t_transfer=3.0, t_compute=1.0)  # 6 <= 6
    assert not single_slot_fits(1, 8, t_transfer=3.5, t_compute=1.0)  # 7 > 6
    # two slots: T_T (α+2) <= T_c n  ->  3 T_T <= 8 T_c
    assert double_buffer_fits(1, 8, t_transfer=2.5, t_compute=1.0)  # 7.5 <= 8
    assert not double_buffer_fits(1, 8, t_transfer=3.0, t_compute=1.0)  # 9 > 8


def test_the_dynamic_scheme_switches_to_two_slots_where_equation_4_fails() -> None:
    # §5.4's example: n = 40, a copy 3.2x a layer's compute. α = 8: 3.2*9 = 28.8 <= 31,
    # one slot; α = 9: 3.2*10 = 32 > 30, two slots (3.2*11 = 35.2 <= 40).
    assert choose_slots(8, 40, 3.2, 1.0) == 1
    assert choose_slots(9, 40, 3.2, 1.0) == 2
    assert plan_layers(9, 40, 3.2, 1.0).layers == uniform_layers(40, 11)
    assert plan_layers(8, 40, 3.2, 1.0).layers == uniform_layers(40, 9)
    # fixed schemes (§7.5's A and B) ignore the times; unmeasured times: one slot
    assert choose_slots(9, 40, 3.2, 1.0, "single") == 1
    assert choose_slots(1, 40, 0.0, 1.0, "double") == 2
    assert choose_slots(5, 40, None, None) == 1
    assert choose_slots(3, 4, 9.0, 1.0, "double") == 1  # α + 2 > n: one slot is all there is
    with pytest.raises(ValueError):
        choose_slots(1, 8, 1.0, 1.0, "triple")


def test_plan_for_zero_is_empty_and_alpha_needs_a_slot_left() -> None:
    assert plan_layers(0, 8).layers == ()
    p = plan_layers(2, 8, scheme="double")
    assert (p.alpha, p.slots, p.m, p.layers) == (2, 2, 4, (0, 2, 4, 6))
    with pytest.raises(ValueError):
        plan_layers(8, 8)


def test_max_alpha_is_the_threshold_and_what_transfers_can_hide() -> None:
    assert max_alpha(40, 0.5) == 20  # no times yet: the threshold alone
    assert max_alpha(4, 0.95) == 3  # at most n - 1
    # T_T = 3.2 T_c: Equation 5 holds up to α + 2 <= 12.5, α = 10
    assert max_alpha(40, 0.5, 3.2, 1.0) == 10
    assert max_alpha(40, 0.1, 3.2, 1.0) == 4  # the threshold binds first
    assert max_alpha(8, 0.5, 100.0, 1.0) == 0  # copies far slower than compute: none
