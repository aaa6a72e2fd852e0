"""The Remapping Controller (MIRAGE §5.5, Algorithm 1): per step, lend weight memory to the
KV cache when KV runs out, and take it back when the KV it added is empty again.

    step():                                         (Algorithm 1, lines 2-13)
      if the KV allocator is running out:           line 3
          remapping(): one more layer lent          lines 4, 15-23
      else:
          foreach added KV unit, newest first:      lines 7-10
              if it holds no KV: revert it          (its layer's weights come back)
          none left: remapping disabled             lines 11-12
      -> the remapped layer count of every model    line 13 (the forward uses it)

One remapped layer lends its weight bytes as one *added KV unit* (the paper's added
tensor). Units are stacked: the newest sits at the top of the KV address range, so it is
the first to be emptied and given back (a page above the capacity line cannot be
committed again).

Which model gives a layer (§5.2, Algorithm 1 lines 16-23): inactive models first, then
active ones, pinned ones last of all; among them the lowest priority first, and at equal
priority the most recently activated first (MRU: its next transfer is furthest away).
A model stops giving at its cap (``max_alpha``: §5.2's threshold and §5.3's bound on
what the transfers can hide). Reversion gives back in the reverse order: the units of
the model that gave last come back first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class KvLender(Protocol):
    """The KV side of the node's budget as the controller sees it."""

    def running_out(self) -> bool:
        """Whether the KV allocator's pending demand exceeds what it can hand out."""
        ...

    def lend(self, nbytes: int) -> None:
        """Count ``nbytes`` of weight memory as KV capacity from now on."""
        ...

    def reclaim(self, nbytes: int) -> bool:
        """Take ``nbytes`` of lent capacity back if the KV pages above the new capacity
        line hold nothing live (they are released); False, nothing changed, if they do."""
        ...


@dataclass
class RemapTarget:
    """One model whose layers may be remapped. ``cap``: most layers it may lend now."""

    name: str
    num_layers: int
    layer_bytes: int
    cap: int
    active: bool = True
    priority: int = 0  # higher = more important (remapped later)
    pinned: bool = False
    activated_at: float = 0.0  # when it last became active (MRU order)
    alpha: int = 0  # layers remapped now

    def order_key(self) -> tuple[bool, bool, int, float]:
        """Sort key: the first in order gives its layers first (pinned models last of all,
        then by activity, priority and MRU)."""
        return (self.pinned, self.active, self.priority, -self.activated_at)


@dataclass
class ControllerState:
    """What the forward needs after a step (Algorithm 1, line 13)."""

    enabled: bool
    alpha: dict[str, int] = field(default_factory=dict)


class RemappingController:
    def __init__(self, lender: KvLender) -> None:
        self._lender = lender
        self._targets: dict[str, RemapTarget] = {}
        self._units: list[tuple[str, int]] = []  # added KV units, oldest first: (model, bytes)
        self.enabled = False
        self.remaps = 0  # layers lent, ever
        self.reversions = 0  # layers given back, ever

    def add(self, target: RemapTarget) -> None:
        self._targets[target.name] = target

    def target(self, name: str) -> RemapTarget:
        return self._targets[name]

    @property
    def lent_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self._units)

    def step(self) -> ControllerState:
        """One scheduler step's decision (Algorithm 1, lines 3-13)."""
        if self._lender.running_out():
            if self._remapping():  # lines 4-5
                self.enabled = True
            # A cap lowered by measured times (§5.3): layers past it go back once empty.
            self._revert(lambda name: self._targets[name].alpha > self._targets[name].cap)
        else:
            self._revert(lambda name: True)  # lines 7-10: the newest added unit first
            if not self._units:  # lines 11-12
                self.enabled = False
        return self.state()

    def _revert(self, wanted: Callable[[str], bool]) -> None:
        """Give back added units from the newest while ``wanted(model)`` and their KV is
        empty (a unit still holding KV keeps every unit below it)."""
        while self._units and wanted(self._units[-1][0]):
            name, nbytes = self._units[-1]
            if not self._lender.reclaim(nbytes):
                return
            self._units.pop()
            self._targets[name].alpha -= 1
            self.reversions += 1

    def state(self) -> ControllerState:
        return ControllerState(self.enabled, {t.name: t.alpha for t in self._targets.values()})

    def order(self) -> list[RemapTarget]:
        """Models in the order they give layers (§5.2)."""
        return sorted(self._targets.values(), key=RemapTarget.order_key)

    def _remapping(self) -> bool:
        """Lend one more layer of the first model in §5.2's order that is below its cap
        (Algorithm 1, lines 15-23); False when every model is at its cap."""
        for target in self.order():
            if target.alpha < min(target.cap, target.num_layers - 1):
                target.alpha += 1
                self._lender.lend(target.layer_bytes)
                self._units.append((target.name, target.layer_bytes))
                self.remaps += 1
                return True
        return False
