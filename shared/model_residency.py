"""What of each model's weights a node already holds, for placement by load time.

Tangram (§3.4, Algorithm 2) places a model that must be activated on the node with the
lowest expected TTFT, and most of that is the time to load the weights the node does not
hold yet. A node's Reuse Store knows, per model, how many of its weight bytes are resident
(its own tensors, or identical ones another model brought) and how fast the node loads the
rest; the nodemgr reports it and the scheduler's placement estimates load time from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ModelResidency:
    """One model's weights on one node."""

    model: str
    resident_bytes: int  # weight bytes already in the node's weight memory (shared count)
    total_bytes: int  # bytes of all its weights
    active: bool  # an engine serves it now

    @property
    def missing_bytes(self) -> int:
        """Bytes an activation on this node would still have to load."""
        return max(0, self.total_bytes - self.resident_bytes)


class ResidencySource(Protocol):
    """Whatever holds a node's weights (the Reuse Store) answers these for its report."""

    def residency(self) -> list[ModelResidency]:
        """Every model the node knows of, resident or not."""
        ...

    def load_bytes_per_s(self) -> float:
        """Measured weight load bandwidth into the node's weight memory; 0.0: not yet."""
        ...
