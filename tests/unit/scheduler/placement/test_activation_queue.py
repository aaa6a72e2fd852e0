"""Algorithm 2 over the queue of activations (Tangram §3.4), worked by hand.

Two nodes, equal bandwidth (10 B/s), models of 100 B. Node "a" holds 80 B of x and 90 B
of y, node "b" nothing. Alone, x and y would each go to "a" (2 s and 1 s of loading
against 10 s on "b"). As one queue (x came first): x takes "a" (line 13 removes it), y
gets "b" though "a" holds more of it; z, third, finds no node left and waits (lines
11-12). Once x shows active on "a", "a" is available again and z gets it.
"""

from __future__ import annotations

import asyncio

from services.scheduler.cluster import Load, ModelSpec, NodeChannels, NodeInfo, NodeRegistry
from services.scheduler.placement import ActivationQueue, best_node
from services.scheduler.routing import Dispatcher, DispatchSettings, RouteRequest, make_policy
from shared.model_catalog import ModelEntry
from shared.model_residency import ModelResidency

HELD = Load(residency=(ModelResidency("x", 80, 100, False), ModelResidency("y", 90, 100, False)),
            load_bytes_per_s=10.0, blocks_free=10)
EMPTY = Load(load_bytes_per_s=10.0, blocks_free=10)


def registry() -> NodeRegistry:
    reg = NodeRegistry(heartbeat_timeout_s=60)
    for node, load in (("a", HELD), ("b", EMPTY)):
        reg.register(NodeInfo(node, f"{node}:1", (ModelSpec("other"),)))
        reg.heartbeat(node, load)
    return reg


def test_the_queue_gives_each_node_one_activation_in_arrival_order() -> None:
    reg = registry()
    nodes = reg.healthy()
    assert best_node("y", nodes).node.node_id == "a"  # type: ignore[union-attr]  # (alone)
    now = [0.0]
    active: set[str] = set()
    q = ActivationQueue(hold_s=30.0, clock=lambda: now[0])

    def choose(m: str, wait: bool = True) -> str | None:
        est = q.choose(m, nodes, lambda _: 100, lambda x: x in active, wait=wait)
        return est.node.node_id if est is not None else None

    assert choose("x") == "a"
    est = q.choose("y", nodes, lambda _: 100, lambda x: x in active)
    assert est is not None and est.node.node_id == "b" and est.load_s == 10.0
    assert choose("z") is None and q.pending() == ["z"]  # (every node is activating)
    assert choose("x") == "a"  # (x's next request joins its activation)
    active.add("x")  # x's node beats with x active: "a" is free again
    assert choose("z") == "a" and q.pending() == []
    assert q.activating() == {"y": "b", "z": "a"}


def test_a_waiting_model_ahead_keeps_its_node_from_a_later_one() -> None:
    reg = registry()
    nodes = reg.healthy()
    now = [0.0]
    q = ActivationQueue(clock=lambda: now[0])
    # x and y both busy elsewhere: z is queued first, then w comes.
    q._activating = {"x": ("a", 0.0), "y": ("b", 0.0)}
    assert q.choose("z", nodes, lambda _: 100, lambda m: False) is None
    now[0] = 1.0
    assert q.choose("w", nodes, lambda _: 100, lambda m: False) is None
    # "a" frees (x active): w asks first, but z is ahead in the queue and takes "a" in
    # this round (line 13), so w still waits; z then commits "a" when it asks.
    assert q.choose("w", nodes, lambda _: 100, lambda m: m == "x") is None
    est = q.choose("z", nodes, lambda _: 100, lambda m: m == "x")
    assert est is not None and est.node.node_id == "a"
    # A request that cannot wait any longer takes the best node, busy or not.
    est = q.choose("w", nodes, lambda _: 100, lambda m: m == "x", wait=False)
    assert est is not None and q.pending() == []


def test_an_activation_that_never_shows_releases_its_node_after_hold_s() -> None:
    reg = registry()
    now = [0.0]
    q = ActivationQueue(hold_s=5.0, clock=lambda: now[0])
    assert q.choose("x", reg.healthy(), lambda _: 100, lambda m: False) is not None
    assert q.choose("y", reg.healthy(), lambda _: 100, lambda m: False) is not None
    assert q.choose("z", reg.healthy(), lambda _: 100, lambda m: False) is None
    now[0] = 6.0
    assert q.choose("z", reg.healthy(), lambda _: 100, lambda m: False) is not None


def test_the_dispatcher_sends_two_evicted_models_to_two_nodes() -> None:
    """Wired: two requests for evicted x and y, one after the other while x's activation
    is under way, go to "a" and "b" (each would go to "a" alone)."""
    async def run() -> list[str]:
        reg = registry()
        d = Dispatcher(reg, make_policy("balanced"), NodeChannels(), DispatchSettings(),
                       catalog=(ModelEntry("x", "/not/here"), ModelEntry("y", "/not/here")))
        return [(await d.pick(RouteRequest(m, f"s-{m}", "t"))).node.node_id
                for m in ("x", "y")]
    assert asyncio.run(run()) == ["a", "b"]
