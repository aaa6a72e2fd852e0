"""Which layers a remapped model streams, and through how many slots (MIRAGE §5.4).

With α layers' weight memory lent to the KV cache, all n layers run in the memory of
n - α. m layers are streamed from the host copy each step, sharing β slots
(m = α + β), the other n - m stay resident:

    n = 8, α = 1, β = 1 (m = 2):  layers 0 and 4 share one slot
    step t:  [0]  1  2  3 [4]  5  6  7 | [0] ...     (circular: layer 7 is followed by 0)
              ^ in the slot            ^ after 4 is computed, layer 0 is copied back in

The m layers sit at uniform intervals around that circle (Equation 3: the time to hide a
transfer behind is the least gap between two streamed layers, largest when the gaps are
equal). β = 1 (one shared slot) moves the least, but a layer's copy can only start once
the layer before it in the slot is computed (Equation 4); β = 2 (double buffering) moves
one layer more per step and lets the copy start a whole gap earlier (Equation 5). The
dynamic scheme (§7.5's C) takes β = 1 while Equation 4 holds and β = 2 beyond.

Pure logic: times in, choices out (the controller feeds it measured times).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("dynamic", "single", "double")


@dataclass(frozen=True)
class LayerPlan:
    """The streamed layers of one model at one α: ``layers`` (ascending) share ``slots``
    slots; each layer's copy goes into the slot freed by the layer ``slots`` places before
    it, around the circle."""

    alpha: int
    slots: int
    layers: tuple[int, ...]

    @property
    def m(self) -> int:
        return len(self.layers)


def uniform_layers(n: int, m: int) -> tuple[int, ...]:
    """``m`` of ``n`` layers at uniform intervals (§5.4), starting at layer 0: the gaps
    differ by at most one layer when m does not divide n."""
    if not 0 < m <= n:
        raise ValueError(f"cannot stream {m} of {n} layers")
    return tuple(i * n // m for i in range(m))


def single_slot_fits(alpha: int, n: int, t_transfer: float, t_compute: float) -> bool:
    """Equation 4: T_T (α + 1) <= T_c (n - α - 1), one slot shared by α + 1 layers."""
    return t_transfer * (alpha + 1) <= t_compute * (n - alpha - 1)


def double_buffer_fits(alpha: int, n: int, t_transfer: float, t_compute: float) -> bool:
    """Equation 5: T_T (α + 2) <= T_c n, two slots shared by α + 2 layers."""
    return t_transfer * (alpha + 2) <= t_compute * n


def choose_slots(alpha: int, n: int, t_transfer: float | None, t_compute: float | None,
                 scheme: str = "dynamic") -> int:
    """β for ``alpha`` remapped layers of ``n``: 1 or 2 by ``scheme`` ("single" is §7.5's
    A, "double" its B, "dynamic" its C: one slot while Equation 4 holds on the measured
    per-layer times, else two). Unmeasured times count as Equation 4 holding (the
    first steps measure them). Two slots need α + 2 <= n."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown remap scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if scheme == "single" or alpha + 2 > n:
        return 1
    if scheme == "double":
        return 2
    if t_transfer is None or t_compute is None:
        return 1
    return 1 if single_slot_fits(alpha, n, t_transfer, t_compute) else 2


def plan_layers(alpha: int, n: int, t_transfer: float | None = None,
                t_compute: float | None = None, scheme: str = "dynamic") -> LayerPlan:
    """The streamed layers for ``alpha`` (0: none, every layer resident)."""
    if alpha <= 0:
        return LayerPlan(0, 0, ())
    if alpha >= n:
        raise ValueError(f"cannot remap {alpha} of {n} layers: one slot must remain")
    slots = choose_slots(alpha, n, t_transfer, t_compute, scheme)
    return LayerPlan(alpha, slots, uniform_layers(n, alpha + slots))


def max_alpha(n: int, cap_fraction: float, t_transfer: float | None = None,
              t_compute: float | None = None) -> int:
    """The most layers that may be remapped: ``cap_fraction`` of n (§5.2's threshold, which
    keeps enough of a model resident to start it), and with measured times the largest α
    whose transfers still hide behind compute with double buffering (§5.3: T_T N <= T_c n,
    N = α + 2 streamed). At most n - 1 (one slot must remain)."""
    cap = min(n - 1, int(cap_fraction * n))
    if t_transfer is None or t_compute is None:
        return max(0, cap)
    best = 0
    for alpha in range(1, cap + 1):
        if double_buffer_fits(alpha, n, t_transfer, t_compute) \
                or single_slot_fits(alpha, n, t_transfer, t_compute):
            best = alpha
    return best
