"""The scheduler's placement round: Algorithm 1 on the registry's view of nodes and models,
with rates measured from requests; models run nowhere are left to on-demand activation."""

from __future__ import annotations

from services.scheduler.cluster import Load, ModelSpec, NodeChannels, NodeInfo, NodeRegistry
from services.scheduler.placement import ModelRates, PlacementLoop
from shared.model_catalog import ModelEntry

GIB = 2**30


def registry(models_on: dict[str, tuple[str, ...]], budget: int = 8 * GIB) -> NodeRegistry:
    reg = NodeRegistry(heartbeat_timeout_s=60)
    for node, models in models_on.items():
        reg.register(NodeInfo(node, f"{node}:1", tuple(ModelSpec(m) for m in models)))
        reg.heartbeat(node, Load(device_budget_bytes=budget))
    return reg


def test_rates_decay_with_their_half_life() -> None:
    now = [0.0]
    rates = ModelRates(half_life_s=10.0, clock=lambda: now[0])
    for _ in range(20):
        rates.record("a")
    r0 = rates.rate("a")
    now[0] = 10.0
    assert abs(rates.rate("a") - r0 / 2) < 1e-9 and rates.rate("b") == 0.0


def test_two_busy_models_on_one_node_are_spread() -> None:
    now = [0.0]
    rates = ModelRates(clock=lambda: now[0])
    for _ in range(50):
        rates.record("a")
        rates.record("b")
    catalog = (ModelEntry("a", "/nowhere/a"), ModelEntry("b", "/nowhere/b"),
               ModelEntry("c", "/nowhere/c"))
    loop = PlacementLoop(registry({"n0": ("a", "b"), "n1": ()}), NodeChannels(), catalog,
                         rates, tau=0.0)
    moves = loop.plan()
    assert len(moves) == 1 and next(iter(moves.values())) == ("n0", "n1")
    # A high τ keeps them where they are; "c" runs nowhere and is not placed.
    assert PlacementLoop(registry({"n0": ("a", "b"), "n1": ()}), NodeChannels(), catalog,
                         rates, tau=1e6).plan() == {}


def test_one_node_or_no_budget_means_no_moves() -> None:
    rates = ModelRates()
    catalog = (ModelEntry("a", "/x"),)
    assert PlacementLoop(registry({"n0": ("a",)}), NodeChannels(), catalog, rates,
                         0.0).plan() == {}
    assert PlacementLoop(registry({"n0": ("a",), "n1": ()}, budget=0), NodeChannels(),
                         catalog, rates, 0.0).plan() == {}
