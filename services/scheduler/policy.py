"""Placement policies: which healthy node serves an inference request.

A policy only decides; the dispatcher does the routing and the registry keeps the facts.
Policies are looked up by name in ``POLICIES`` (unknown names fail loudly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.nodes import Node


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

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        """Pick one of ``nodes`` (all healthy and serving ``request.model``), or None if empty.

        Must not mutate the nodes; the caller records the routing.
        """
        ...


class BalancedPolicy:
    """A request that follows an advisory goes to the node the advisory chose (its KV is
    being prefetched there) while that node can take it. Otherwise (and for advisories):
    least loaded (running + waiting + routed); ties: the node holding the session's KV,
    then fewest routed, then least recently used (Symphony §3.3: load before locality)."""

    name = "balanced"

    def choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes:
            return None
        if request.advised:
            for n in nodes:
                if n.node_id == request.advised:
                    return n
        return min(nodes, key=lambda n: (n.score(), n.node_id != request.holder, n.routed,
                                         n.last_routed, n.node_id))


POLICIES: dict[str, type[Policy]] = {"balanced": BalancedPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
