"""Placement policies: which healthy node serves an inference request or an advisory, and
what the cluster does with the session's KV there (DESIGN §6).

A policy only decides: it returns a plan (``plan.py``) that the dispatcher and the advisor
carry out; the registry keeps the facts. Policies are looked up by name in ``POLICIES``
(unknown names fail loudly).

    policy     node                              request's KV            advisory
    balanced   least loaded at arrival; ties:    reused; pulled from     prefetched (from the
               the KV holder; advised: its node  the holder's kvstore    holder's kvstore)
    priority   balanced; priority > 0 spread     as balanced             as balanced; priority
               over the nodes first                                      > 0 straight to device
    sticky     the holder while in rotation      reused where it is      only recorded
    recompute  least loaded                      not reused at all       only recorded
    prefix     longest device prefix; none:      device cache only; no   only recorded
               least loaded                      DRAM/SSD/S3 tiers

``priority`` follows Symphony §3.6 and §4.5; ``sticky`` is an InferCept-like baseline (a
session stays on its first node; KV never moves between nodes); ``recompute`` a
vLLM-without-offload baseline (not even the device prefix cache is reused); ``prefix``
precise prefix-aware routing as llm-d does it (KV only in device memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from services.scheduler.cluster import Node
from services.scheduler.routing.plan import AdvisoryPlan, RoutePlan, RouteRequest


class Policy(Protocol):
    """Given one node, both methods plan on it: the caller may have chosen it already (a
    catalogue model is activated on the node of least KV pressure, whatever the policy).
    Neither mutates the nodes; the caller records the routing."""

    name: str

    def route(self, nodes: Sequence[Node], request: RouteRequest) -> RoutePlan | None:
        """Plan a generation on one of ``nodes`` (all healthy and serving
        ``request.model``); None when ``nodes`` is empty."""
        ...

    def advise(self, nodes: Sequence[Node], request: RouteRequest) -> AdvisoryPlan | None:
        """Plan an advisory on one of ``nodes``; None when ``nodes`` is empty."""
        ...


def _holder_elsewhere(node: Node, request: RouteRequest) -> str:
    """The node holding the session's KV when that is not ``node`` ("": none, or it is)."""
    return request.holder if request.holder != node.node_id else ""


def _prefix_rank(node: Node, request: RouteRequest) -> int:
    """0 for the node most recently holding the request's leading context, 1 the next...;
    past all of them for the others (a new session's locality: ``cluster/prefixes.py``)."""
    try:
        return request.prefix_nodes.index(node.node_id)
    except ValueError:
        return len(request.prefix_nodes)


def _advised_blind(request: RouteRequest) -> bool:
    """Whether the request's advisory chose its node blind: its session had nothing stored
    anywhere and its leading context (an agent team's shared system prompt) was on no node
    yet, so load alone decided, and the advisory could stage nothing. If another node holds
    that context by the time the turn comes (its predecessor saved it meanwhile), following
    the advisory would recompute the context there: the turn is routed as if unadvised
    (issue 41: an advisory never makes a turn slower)."""
    return (not request.holder and bool(request.prefix_nodes)
            and request.advised not in request.prefix_nodes)


def _least_loaded(nodes: Sequence[Node]) -> Node:
    return min(nodes, key=lambda n: (n.score(), n.routed, n.last_routed, n.node_id))


MOVE_TOKENS = 0  # scheduler.move_tokens's default: off (bench/README.md, issue 42)


class BalancedPolicy:
    """A request that follows an advisory goes to the node the advisory chose (its KV is
    being prefetched there) while that node can take it. Otherwise (and for advisories):
    least loaded by the load expected at arrival (running + waiting + routed + advisories
    pending there, ``Node.expected``, less what will be gone by then, ``Node.expected_at``:
    generations that ended since the node's last beat and, for an advisory, those
    expected to end before it arrives); ties: the node holding the session's KV,
    then the node holding its leading context (a shared system prompt), then fewest
    routed, then least recently used (Symphony §3.3: load before locality).
    The KV follows the session: the chosen node pulls it from the holder's kvstore, and an
    advisory's node prefetches it.

    A locality margin (``move_tokens``): a session leaves its holder only when the load it
    escapes outweighs what moving costs. Moving pulls its whole history across and takes
    device memory from the sessions on the new node; staying waits behind a few more
    requests. So a session of T tokens stays while its holder's expected load exceeds the
    least loaded node's by at most ``T // move_tokens`` requests (0, the default: load
    alone decides; a short session still moves for a difference of one). Off by default:
    on the simulated agent sessions it narrowed balanced's gap to sticky only inside the
    noise (bench/README.md)."""

    name = "balanced"

    def __init__(self, move_tokens: int = MOVE_TOKENS) -> None:
        self.move_tokens = move_tokens

    def route(self, nodes: Sequence[Node], request: RouteRequest) -> RoutePlan | None:
        node = self._choose(nodes, request)
        if node is None:
            return None
        return RoutePlan(node, reuse_kv=True, pull_from=_holder_elsewhere(node, request))

    def advise(self, nodes: Sequence[Node], request: RouteRequest) -> AdvisoryPlan | None:
        node = self._choose(nodes, request)
        if node is None:
            return None
        return AdvisoryPlan(node, prefetch=True, pull_from=_holder_elsewhere(node, request))

    def _choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes:
            return None
        if request.advised and not _advised_blind(request):
            for n in nodes:
                if n.node_id == request.advised:
                    return n
        best = min(nodes, key=lambda n: (n.expected_at(request.gone.get(n.node_id, 0)),
                                         n.node_id != request.holder,
                                         _prefix_rank(n, request), n.routed,
                                         n.last_routed, n.node_id))
        return self._stay(nodes, best, request)

    def _stay(self, nodes: Sequence[Node], best: Node, request: RouteRequest) -> Node:
        """``best``, or the session's holder while the load difference is inside the
        session's margin (see the class doc)."""
        if (not request.holder or best.node_id == request.holder or not self.move_tokens
                or request.holder_tokens < self.move_tokens):
            return best
        margin = request.holder_tokens // self.move_tokens
        for n in nodes:
            if n.node_id == request.holder:
                gap = (n.expected_at(request.gone.get(n.node_id, 0))
                       - best.expected_at(request.gone.get(best.node_id, 0)))
                return n if gap <= margin else best
        return best


class PriorityPolicy(BalancedPolicy):
    """``balanced`` for regular sessions. A high-priority session (priority > 0) goes to
    the node with the fewest high-priority advisories pending, then the least loaded: a
    sticky placement would pile paid users onto the nodes that served them first
    (Symphony §3.6 "Additional scheduling policies"). Its advisory prefetches straight into
    device memory (the engine evicts its prefix cache for it) and the engine admits its
    request before waiting lower-priority ones."""

    name = "priority"

    def advise(self, nodes: Sequence[Node], request: RouteRequest) -> AdvisoryPlan | None:
        plan = super().advise(nodes, request)
        if plan is None or request.priority <= 0:
            return plan
        return dataclasses.replace(plan, straight_to_device=True)

    def _choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes or request.priority <= 0 or request.advised:
            return super()._choose(nodes, request)
        return min(nodes, key=lambda n: (n.advised_priority,
                                         n.expected_at(request.gone.get(n.node_id, 0)),
                                         n.node_id != request.holder,
                                         _prefix_rank(n, request), n.routed,
                                         n.last_routed, n.node_id))


class StickyPolicy:
    """A session's turns go to the node of its first turn (the holder) while it is in
    rotation; a new session, or one whose node left, goes to the least loaded node. KV is
    reused where it is and never moved; advisories are only recorded."""

    name = "sticky"

    def route(self, nodes: Sequence[Node], request: RouteRequest) -> RoutePlan | None:
        node = self._choose(nodes, request)
        return RoutePlan(node, reuse_kv=True) if node is not None else None

    def advise(self, nodes: Sequence[Node], request: RouteRequest) -> AdvisoryPlan | None:
        node = self._choose(nodes, request)
        return AdvisoryPlan(node, prefetch=False) if node is not None else None

    def _choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes:
            return None
        for n in nodes:
            if n.node_id == request.holder:
                return n
        return _least_loaded(nodes)


class RecomputePolicy:
    """Least loaded, blind to where KV is: every turn recomputes its whole history;
    advisories are only recorded."""

    name = "recompute"

    def route(self, nodes: Sequence[Node], request: RouteRequest) -> RoutePlan | None:
        return RoutePlan(_least_loaded(nodes), reuse_kv=False) if nodes else None

    def advise(self, nodes: Sequence[Node], request: RouteRequest) -> AdvisoryPlan | None:
        return AdvisoryPlan(_least_loaded(nodes), prefetch=False) if nodes else None


class PrefixPolicy:
    """Precise prefix-aware routing, a baseline users pick today (llm-d's KV-cache-aware
    scorer): the node whose device holds the longest leading run of the prompt's block
    hashes (``request.prefix_hits``), ties to the least loaded of them; when no node holds
    any, the least loaded. KV lives only in device memory: the engine reuses its device
    prefix cache and nothing else (no DRAM, SSD or S3 tier, no pull from a peer, nothing
    saved); advisories are only recorded."""

    name = "prefix"

    def route(self, nodes: Sequence[Node], request: RouteRequest) -> RoutePlan | None:
        node = self._choose(nodes, request)
        return RoutePlan(node, reuse_kv=True, device_only=True) if node is not None else None

    def advise(self, nodes: Sequence[Node], request: RouteRequest) -> AdvisoryPlan | None:
        node = self._choose(nodes, request)
        return AdvisoryPlan(node, prefetch=False) if node is not None else None

    def _choose(self, nodes: Sequence[Node], request: RouteRequest) -> Node | None:
        if not nodes:
            return None
        hits = dict(request.prefix_hits)
        best = max(hits.get(n.node_id, 0) for n in nodes)
        if best == 0:
            return _least_loaded(nodes)
        return _least_loaded([n for n in nodes if hits.get(n.node_id, 0) == best])


POLICIES: dict[str, type[Policy]] = {
    "balanced": BalancedPolicy, "priority": PriorityPolicy, "sticky": StickyPolicy,
    "recompute": RecomputePolicy, "prefix": PrefixPolicy,
}


def make_policy(name: str, move_tokens: int = MOVE_TOKENS) -> Policy:
    """The policy called ``name``; ``move_tokens`` is the balanced family's locality
    margin (``BalancedPolicy``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(move_tokens) if issubclass(cls, BalancedPolicy) else cls()
