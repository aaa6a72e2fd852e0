"""Which of a node's models lend their layers' weight memory to KV, and when they take it
back (MIRAGE §5.2 across the node; the engine's side is ``engine/remap/runtime.py``).

When an engine of the node has requests waiting for KV pages and the broker could take no
pages back from the others, the broker asks one more engine to lend one more layer's
weight memory to the node's budget (Algorithm 1 grows α by one a step):

    candidates  engines with nothing waiting that can still lend (below their cap)
    order       idle models (nothing running) before active ones (``give_way``'s
                idle_weights before active_weights; reversed if configured so), then the
                lowest catalogue ``priority`` first, at equal priority the looser TTFT SLO
                (Prism's), pinned models last of all

The lending engine hands the bytes to the node's ledger (its weight bytes drop by them:
any engine's KV may take them) and streams those layers when it computes. Reversion: once
no engine has waited for ``revert_after_s``, every lender takes its layers back, the most
important first, as far as the ledger has the bytes free again (KV that still holds them
keeps them lent until it is freed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.give_way import GiveWay, parse_give_way
from shared.model_catalog import DEFAULT_TTFT_SLO_S, ModelEntry
from shared.proto import engine_pb2


@dataclass(frozen=True)
class Lender:
    """What the order needs of one engine (from its Status and the catalogue)."""

    name: str  # the engine's address
    running: int
    waiting: int
    lendable_layers: int  # more it may lend now
    node_layers: int  # lent to the node now
    priority: int = 0
    pinned: bool = False
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S

    def key(self, give_way: GiveWay) -> tuple[bool, bool, int, float]:
        """Sort key: first in order lends first (§5.2)."""
        active = self.running > 0
        return (self.pinned, active if give_way.idle_first else not active, self.priority,
                -self.ttft_slo_s)


def catalog_rank(model: str, entries: dict[str, ModelEntry]) -> tuple[int, bool, float]:
    """A model's priority, pin and TTFT SLO (the defaults when it is not catalogued)."""
    e = entries.get(model)
    return (0, False, DEFAULT_TTFT_SLO_S) if e is None else (e.priority, e.pin, e.ttft_slo_s)


def next_lender(engines: Sequence[Lender], give_way: GiveWay) -> Lender | None:
    """The engine to lend one more layer now, or None (nothing waits, or none can lend)."""
    if not any(e.waiting for e in engines):
        return None
    ready = [e for e in engines if not e.waiting and e.lendable_layers > 0]
    return min(ready, key=lambda e: e.key(give_way)) if ready else None


def revert_order(engines: Sequence[Lender], give_way: GiveWay) -> list[Lender]:
    """The engines holding layers lent to the node, the most important first (the reverse
    of the lending order): they take their weights back first."""
    lent = [e for e in engines if e.node_layers > 0]
    return sorted(lent, key=lambda e: e.key(give_way), reverse=True)


def weights_lent(remaps: Iterable[engine_pb2.RemapCounters]) -> bool:
    """Whether an engine of the node lends weight memory to KV now while its give-way order
    puts prefetched KV first: the prefetcher then brings no more KV into the device."""
    return any(r.alpha > 0 and parse_give_way(r.give_way).prefetch_first for r in remaps)
