"""One order for what gives way when a node's KV runs out (MIRAGE §5.2 with Symphony §3.4
and Tangram §3.3), read by every piece that frees device memory for KV:

    prefetched_kv   advised sessions' KV copied ahead into the device, later layers
                    first (the engine's allocator purges it; the prefetcher stops
                    bringing more while weights are lent)
    idle_weights    inactive / idle models' weights: the Reuse Store's inactive tensors
                    and idle engines' layers lent to the node's budget (the broker)
    active_weights  active models' layers, lowest priority first: lent to the node by
                    the broker, or to its own KV by a starving engine's controller

The order is one setting, ``engine.remap.give_way`` (a comma list of the three stages,
default as above); an engine reports it in its Status so that the node's broker and
prefetcher follow the same order as the engine's controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from shared.config import ConfigError

PREFETCHED_KV = "prefetched_kv"
IDLE_WEIGHTS = "idle_weights"
ACTIVE_WEIGHTS = "active_weights"
STAGES = (PREFETCHED_KV, IDLE_WEIGHTS, ACTIVE_WEIGHTS)
DEFAULT = ",".join(STAGES)
ALIASES = {"prefetch_first": DEFAULT,  # (the setting's first two values)
           "weights_first": f"{IDLE_WEIGHTS},{ACTIVE_WEIGHTS},{PREFETCHED_KV}"}
CHOICES = (*(",".join(p) for p in permutations(STAGES)), *ALIASES)


@dataclass(frozen=True)
class GiveWay:
    """The stages in the order they give way (first = first to go)."""

    order: tuple[str, ...] = STAGES

    def before(self, first: str, then: str) -> bool:
        """Whether ``first`` gives way before ``then``."""
        return self.order.index(first) < self.order.index(then)

    @property
    def prefetch_first(self) -> bool:
        """Prefetched KV goes before any weight is lent (and no prefetch fills the device
        while weights are lent)."""
        return self.order[0] == PREFETCHED_KV

    @property
    def idle_first(self) -> bool:
        """Idle models lend their weights before active ones do (§5.2)."""
        return self.before(IDLE_WEIGHTS, ACTIVE_WEIGHTS)

    def __str__(self) -> str:
        return ",".join(self.order)


def parse_give_way(text: str, key: str = "engine.remap.give_way") -> GiveWay:
    """The order a setting names (empty: the default); ConfigError names ``key``."""
    text = ALIASES.get(text.strip(), text.strip()) or DEFAULT
    order = tuple(s.strip() for s in text.split(","))
    if sorted(order) != sorted(STAGES):
        raise ConfigError(f"{key}: {text!r} must name each of {', '.join(STAGES)} once, "
                          f"first to give way first (default {DEFAULT})")
    return GiveWay(order)
