"""The nodemgr's activator with one engine and two catalogue models requested at once: the
second activation must not take the engine while the first is loading into it (it looks
empty then), nor evict it; it waits, then swaps the first model out once it is idle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.nodemgr.activation import Activator
from services.nodemgr.engine_set import EngineSet
from services.nodemgr.wire import EngineSnapshot
from shared.model_catalog import ModelEntry
from shared.model_info import ModelInfo


class FakeEngine:
    """An engine's Activate/Evict/Status; an activation holds until ``gate`` opens."""

    def __init__(self) -> None:
        self.model = ""
        self.loading = 0
        self.most_loading = 0
        self.calls: list[str] = []
        self.gate = asyncio.Event()

    async def Activate(self, request: Any, timeout: float) -> None:  # (gRPC method names)
        self.calls.append(f"activate {request.served_model_name}")
        self.loading += 1
        self.most_loading = max(self.most_loading, self.loading)
        try:
            await self.gate.wait()
        finally:
            self.loading -= 1
        self.model = request.served_model_name

    async def Evict(self, request: Any, timeout: float) -> None:  # (gRPC method names)
        self.calls.append(f"evict {self.model}")
        self.model = ""

    def models(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=self.model)] if self.model else []


def one_engine_node(tmp_path: Any) -> tuple[Activator, FakeEngine]:
    engines = EngineSet(["127.0.0.1:1"], 1.0)
    fake = FakeEngine()
    link: Any = engines.links[0]
    link.stub = fake

    async def raw_status(saved_after: int = 0) -> SimpleNamespace:
        return SimpleNamespace(models=fake.models(), running=0, waiting=0)

    async def status(saved_after: int = 0) -> EngineSnapshot:
        return EngineSnapshot(models=tuple(ModelInfo(m.name) for m in fake.models()))

    link.raw_status, link.status = raw_status, status
    for name in ("alpha", "beta"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    catalog = tuple(ModelEntry(n, str(tmp_path / n)) for n in ("alpha", "beta"))
    return Activator(engines, catalog, evict_idle_s=0.0, wait_s=5.0), fake


async def test_a_second_activation_waits_for_the_engine_the_first_is_loading(tmp_path: Any
                                                                           ) -> None:
    activator, fake = one_engine_node(tmp_path)
    await activator.engines.status()
    first = asyncio.create_task(activator.engine_for("alpha"))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(activator.engine_for("beta"))
    await asyncio.sleep(0.35)  # several of the second's retries while alpha loads
    assert fake.calls == ["activate alpha"] and not second.done()
    fake.gate.set()
    links = await asyncio.wait_for(asyncio.gather(first, second), 5.0)
    assert links[0] is links[1] is activator.engines.links[0]
    assert fake.calls == ["activate alpha", "evict alpha", "activate beta"]
    assert fake.most_loading == 1 and fake.model == "beta"


async def test_a_model_with_a_request_on_its_way_is_not_evicted(tmp_path: Any) -> None:
    """A request the node has taken for alpha but its engine does not count yet (it is
    still on its way): alpha looks idle to the engine, yet is not swapped out under it."""
    activator, fake = one_engine_node(tmp_path)
    fake.model = "alpha"
    fake.gate.set()
    await activator.engines.status()
    activator.enter("alpha")
    swap = asyncio.create_task(activator.engine_for("beta"))
    await asyncio.sleep(0.35)
    assert fake.calls == [] and not swap.done()
    activator.leave("alpha")
    await asyncio.wait_for(swap, 5.0)
    assert fake.calls == ["evict alpha", "activate beta"]


async def test_an_advised_model_is_held_until_its_advisory_ends(tmp_path: Any) -> None:
    """An advisory for alpha is pending (its request is coming): alpha is idle but not
    swapped out for beta; once the advisory ends (invalidated, expired, followed) it may be."""
    activator, fake = one_engine_node(tmp_path)
    fake.model = "alpha"
    fake.gate.set()
    await activator.engines.status()
    activator.hold("adv-1", "alpha", ttl_s=60.0)
    swap = asyncio.create_task(activator.engine_for("beta"))
    await asyncio.sleep(0.35)
    assert fake.calls == [] and not swap.done()
    assert not await activator.evict("alpha")  # (nor by a placement move)
    assert activator.release("adv-1") and not activator.release("adv-1")
    await asyncio.wait_for(swap, 5.0)
    assert fake.calls == ["evict alpha", "activate beta"]


async def test_a_hold_whose_advisory_lapsed_untold_ends_by_itself(tmp_path: Any) -> None:
    now = [0.0]
    activator, _ = one_engine_node(tmp_path)
    activator._clock = lambda: now[0]
    activator.hold("adv-1", "alpha", ttl_s=10.0)
    assert activator.advised() == {"alpha"} and activator.holding() == {"adv-1"}
    now[0] = 10.5
    assert activator.advised() == frozenset() and activator.holding() == frozenset()
