"""The data of the device prefetch: an advisory's order and its entry in the book.

    PrefetchOrder   what the event loop found for an advised session (plain data)
    Advised         the book's entry: the order, its clock, the layers held on the
                    device, the load in flight (a grant per layer it writes)

    held:    [ layer 0: block per hash | layer 1: ... | ... ]     layers [0, len(held))
    grants:  (layer, block per hash, the new blocks the load writes) per granted layer
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.layer_readiness import LayerReadiness
from services.engine.reuse_plan import ReusePlan
from shared.session_key import SessionKey

# How an advisory left the book.
FOLLOWED, EXPIRED, INVALIDATED, REPLACED = "followed", "expired", "invalidated", "replaced"
# How much of a request's prompt was on blocks an advisory prefetched.
DEVICE_PREFETCHED, DEVICE_PARTIAL = "device_prefetched", "device_partial"
LAYERS, SESSIONS = "layers", "sessions"  # purge (and fill) orders

Grant = tuple[int, list[int], set[int]]  # (layer, block per hash, the new blocks written)


@dataclass(frozen=True)
class PrefetchOrder:
    """What the event loop found for an advised session: its stored block hashes and the
    kvstore spans (with a lease) covering blocks ``[0, len(hashes))``."""

    session: SessionKey
    hashes: tuple[bytes, ...]
    plan: ReusePlan
    priority: int = 0
    ttl_s: float = 30.0
    straight: bool = False  # the priority policy: may purge lower priorities at any layer


@dataclass(eq=False)
class Advised:
    """An advised session in the book (worker thread only)."""

    order: PrefetchOrder
    advised_at: float
    expires_at: float
    held: list[list[int]] = field(default_factory=list)  # layers [0, k): block per hash
    loading: LayerReadiness | None = None
    grants: list[Grant] = field(default_factory=list)  # of the load in flight
    lease_used: bool = False
    failed: bool = False
    retire: str = ""  # leaves the book once its load has ended
    loaded_bytes: int = 0

    @property
    def key(self) -> SessionKey:
        return self.order.session

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return self.order.hashes

    @property
    def top_layer(self) -> int:
        """The highest layer held (-1: none)."""
        return len(self.held) - 1
