"""Where advisories go and what they count for, without I/O (Symphony §3.3, §3.6).

An advisory is a request on its way, placed by the load expected at its arrival (the
generations that will have ended by then do not count: ``cluster/inflight.py``): the
policy plans it (``Policy.advise``) as it would
route the request, and until the advisory is followed, invalidated, replaced or expires,
one whose node prefetches counts on that node (``Node.advised``), so advisories made while
the cluster is idle spread instead of all choosing the node that looks least loaded now.
The ``Advisor`` adds the calls to the nodes, the metrics and the throttle; ``bench/sim``
drives this class on a simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.advisory.book import CLIENT, Advisory, AdvisoryBook
from services.scheduler.cluster import (
    HOLDER_SLACK,
    InFlight,
    Node,
    NodeRegistry,
    SessionDirectory,
    SessionPlace,
)
from services.scheduler.placement import ActivationQueue, Estimate
from services.scheduler.routing import AdvisoryPlan, Policy, RouteRequest


@dataclass(frozen=True)
class Placed:
    advisory: Advisory
    plan: AdvisoryPlan  # the node, and what it does now
    ended: list[tuple[Advisory, str]]  # the advisories it ended (replaced, crowded out)
    place: SessionPlace | None  # where the session's KV is, if known
    source: Node | None  # the live node to pull the KV from (None: the node's own tiers)
    # The model runs nowhere: the node (Tangram Algorithm 2) activates it now (warms it)
    warm: Estimate | None = None

    @property
    def node(self) -> Node:
        return self.plan.node

    @property
    def kv_tokens(self) -> int:
        """The session's last turn as the scheduler knows it (0: unknown)."""
        p = self.place
        return (p.turn_tokens or p.saved_tokens) if p is not None else 0


class AdvisoryPlacement:
    """Event-loop only (or one simulated clock)."""

    def __init__(self, book: AdvisoryBook, registry: NodeRegistry, policy: Policy,
                 sessions: SessionDirectory, catalog: frozenset[str] = frozenset(),
                 inflight: InFlight | None = None,
                 activations: ActivationQueue | None = None,
                 model_bytes: Callable[[str], int] = lambda _: 0) -> None:
        self.book = book
        # The generations running now and when each should end (None: the load of now).
        self.inflight = inflight
        self.registry = registry
        self.policy = policy
        self.sessions = sessions
        self.catalog = catalog  # models the cluster may serve though no node runs them now
        # The queue of activations the dispatcher's requests for evicted models join (one
        # Algorithm 2 for both), and a model's bytes as the catalogue's files say (0:
        # unknown; the nodes' residency reports say it then).
        self.activations = activations if activations is not None else ActivationQueue()
        self.model_bytes = model_bytes

    def place(self, tenant: str, session_id: str, model: str, priority: int = 0,
              expected_arrival_s: float = 0.0, origin: str = CLIENT,
              tools: tuple[str, ...] = (), life_s: float = 0.0) -> Placed | None:
        """Plan the advisory and record it; None when no node serves ``model``.
        Raises ``TooManyAdvisories`` when the tenant has its share pending."""
        place = self.sessions.where(tenant, session_id)
        nodes, warm = self._candidates(model)
        route = RouteRequest(model, session_id, tenant, priority,
                             holder=place.node_id if place else "",
                             holder_tokens=place.turn_tokens if place else 0,
                             gone=self.inflight.gone(nodes, expected_arrival_s)
                             if self.inflight is not None else {})
        plan = self.policy.advise(nodes, route)
        if plan is None:
            return None
        adv, ended = self.book.add(tenant, session_id, model, plan.node.node_id, priority,
                                   expected_arrival_s, prefetch=plan.prefetch,
                                   source=origin, tools=tools, life_s=life_s)
        for old, _ in ended:
            self._count(old, -1)
        self._count(adv, +1)
        source = None
        if plan.pull_from:
            holder = self.registry.get(plan.pull_from)
            if holder is not None and self.registry.alive(holder, slack=HOLDER_SLACK):
                source = holder
        return Placed(adv, plan, ended, place, source, warm)

    def _candidates(self, model: str) -> tuple[list[Node], Estimate | None]:
        """The nodes a request for ``model`` could go to now (those behind only if all are).
        A catalogue model active nowhere: the one node its request would activate it on,
        which activates it now, before the request, then prefetches the session (its
        estimate is the second value). The node comes from the queue of activations the
        requests for evicted models join (Tangram §3.4, Algorithm 2: ``ActivationQueue``),
        the advisory in it as an early request: a node given to another model's activation
        is not given to this one too, and the request that follows joins this activation.
        An advisory does not wait in the queue (it answers now, ahead of its request): with
        every node taken, it gets the best node among all, as a request past half its wait
        does."""
        serving = self.registry.healthy(model)
        if not serving and model in self.catalog:
            free = [n for n in self.registry.healthy() if not self.registry.behind(n)]
            warm = self.activations.choose(model, free, self.model_bytes,
                                           lambda m: bool(self.registry.healthy(m)),
                                           wait=False)
            return ([warm.node] if warm is not None else []), warm
        return [n for n in serving if not self.registry.behind(n)] or serving, None

    def follow(self, tenant: str, session_id: str) -> tuple[Advisory | None, str]:
        """The session's advisory, ended by its request (see ``AdvisoryBook.follow``)."""
        adv, how = self.book.follow(tenant, session_id)
        if adv is not None:
            self._count(adv, -1)
        return adv, how

    def invalidate(self, tenant: str, advisory_id: str) -> Advisory | None:
        adv = self.book.invalidate(tenant, advisory_id)
        if adv is not None:
            self._count(adv, -1)
        return adv

    def sweep(self) -> list[Advisory]:
        """The advisories that expired unfollowed, ended."""
        lapsed = self.book.sweep()
        for adv in lapsed:
            self._count(adv, -1)
        return lapsed

    def _count(self, adv: Advisory, delta: int) -> None:
        if not adv.prefetch:  # (a baseline's: it is only recorded)
            return
        self.registry.advised_pending(adv.node_id, delta)
        if adv.priority > 0:  # (``priority`` spreads these)
            self.registry.advised_priority(adv.node_id, delta)
