"""Placement policies: which healthy node serves an inference request or an advisory.

A policy only decides; the dispatcher does the routing and the registry keeps the facts.
Policies are looked up by name in ``POLICIES`` (unknown names fail loudly). Besides
``choose``, each says what the cluster does with KV under it (DESIGN §6):

- ``balanced`` (default): load first, KV follows the session, advisories prefetch;
- ``priority``: ``balanced``, but high-priority sessions are spread evenly over the nodes
  and their advisories prefetch straight into device memory (Symphony §3.6, §4.5);
- ``sticky`` (an InferCept-like baseline): a session stays on its first node while that
  node is in rotation; KV is never moved between nodes and advisories prefetch nothing;
- ``recompute`` (a vLLM-without-offload baseline): least loaded, and no KV is reused at
  all, not even the device prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.cluster import Node


@dataclass(frozen=True)
class RouteRequest:
    model: str
    session_id: str = ""
    tenant: str = "default"
    priority: int = 0
    holder: str = ""  # the node holding the session's KV (its last turn's), if known
    advised: str = ""  # the node an advisory chose for this request (its KV goes there)


class Policy(Protocol):
    name: str
    reuses_kv: bool  # requests may reuse stored or cached KV
    moves_kv: bool  # a session's KV is pulled from the node that holds it
    prefetches: bool  # advisories make the chosen node prefetch
    straight_to_device: bool  # high-priority advisories may evict the device cache to fit

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        """Pick one of ``nodes`` (all healthy and serving ``request.model``), or None if empty.

        Must not mutate the nodes; the caller records the routing.
        """
        ...


class BalancedPolicy:
    """A request that follows an advisory goes to the node the advisory chose (its KV is
    being prefetched there) while that node can take it. Otherwise (and for advisories):
    least loaded by the load expected at arrival (running + waiting + routed + advisories
    pending there, ``Node.expected``); ties: the node holding the session's KV,
    then fewest routed, then least recently used (Symphony §3.3: load before locality)."""

    name = "balanced"
    reuses_kv = moves_kv = prefetches = True
    straight_to_device = False

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes:
            return None
        if request.advised:
            for n in nodes:
                if n.node_id == request.advised:
                    return n
        return min(nodes, key=lambda n: (n.expected(), n.node_id != request.holder,
                                         n.routed, n.last_routed, n.node_id))


class PriorityPolicy(BalancedPolicy):
    """``balanced`` for regular sessions. A high-priority session (priority > 0) goes to
    the node with the fewest high-priority advisories pending, then the least loaded: a
    sticky placement would pile paid users onto the nodes that served them first
    (Symphony §3.6 "Additional scheduling policies"). Its advisory prefetches straight into
    device memory (the engine evicts its prefix cache for it) and the engine admits its
    request before waiting lower-priority ones."""

    name = "priority"
    straight_to_device = True

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes or request.priority <= 0 or request.advised:
            return super().choose(nodes, request)
        return min(nodes, key=lambda n: (n.advised_priority, n.expected(),
                                         n.node_id != request.holder, n.routed,
                                         n.last_routed, n.node_id))


def _least_loaded(nodes: Sequence[Node]) -> Node:
    return min(nodes, key=lambda n: (n.score(), n.routed, n.last_routed, n.node_id))


class StickyPolicy:
    """A session's turns go to the node of its first turn (the holder) while it is in
    rotation; a new session, or one whose node left, goes to the least loaded node."""

    name = "sticky"
    reuses_kv = True
    moves_kv = prefetches = straight_to_device = False

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes:
            return None
        for n in nodes:
            if n.node_id == request.holder:
                return n
        return _least_loaded(nodes)


class RecomputePolicy:
    """Least loaded, blind to where KV is: every turn recomputes its whole history."""

    name = "recompute"
    reuses_kv = moves_kv = prefetches = straight_to_device = False

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        return _least_loaded(nodes) if nodes else None


POLICIES: dict[str, type[Policy]] = {
    "balanced": BalancedPolicy, "priority": PriorityPolicy, "sticky": StickyPolicy,
    "recompute": RecomputePolicy,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
