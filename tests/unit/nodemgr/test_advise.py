"""The nodemgr's Advise for a catalogue model no engine of the node serves: it activates the
model, then prefetches; an advisory that ends while the model loads prefetches nothing."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from services.nodemgr.advisory_prefetcher import Advice
from services.nodemgr.engine_set import UnknownModel
from services.nodemgr.grpc_service import NodeManagerServicer
from shared.proto import nodemgr_pb2


class Engines:
    def __init__(self) -> None:
        self.active: set[str] = {"here"}

    def for_model(self, model: str) -> str:
        if model not in self.active:
            raise UnknownModel(model)
        return model


class Activator:
    def __init__(self, engines: Engines) -> None:
        self.catalog = {"here": None, "evicted": None}
        self.engines = engines
        self.loading = asyncio.Event()  # set: the activation completes
        self.activated: list[str] = []
        self.held: dict[str, str] = {}  # advisory id -> the model it keeps from eviction

    def used(self, model: str) -> None:
        pass

    def hold(self, advisory_id: str, model: str, ttl_s: float) -> None:
        self.held[advisory_id] = model

    def release(self, advisory_id: str) -> bool:
        return self.held.pop(advisory_id, None) is not None

    def holding(self) -> frozenset[str]:
        return frozenset(self.held)

    def enter(self, model: str) -> None:
        pass

    async def engine_for(self, model: str) -> str:
        await self.loading.wait()
        self.engines.active.add(model)
        self.activated.append(model)
        return model


class Prefetcher:
    def __init__(self) -> None:
        self.advised: list[Advice] = []

    def advise(self, advice: Advice) -> bool:
        self.advised.append(advice)
        return True

    def invalidate(self, advisory_id: str, expired: bool = False) -> bool:
        return False


def servicer() -> tuple[NodeManagerServicer, Activator, Prefetcher]:
    engines, prefetcher = Engines(), Prefetcher()
    activator = Activator(engines)
    s = NodeManagerServicer("node0", cast(Any, engines), "kv:1", lambda why: None,
                            prefetcher=cast(Any, prefetcher), activator=cast(Any, activator))
    return s, activator, prefetcher


def advise(advisory_id: str, model: str) -> nodemgr_pb2.AdviseRequest:
    return nodemgr_pb2.AdviseRequest(advisory_id=advisory_id, session_id="s", model=model)


async def test_an_evicted_model_is_activated_then_prefetched_into() -> None:
    s, activator, prefetcher = servicer()
    reply = await s.Advise(advise("a1", "evicted"), cast(Any, None))
    assert reply.accepted and prefetcher.advised == []  # not before the model is loaded
    activator.loading.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert activator.activated == ["evicted"]
    assert [a.advisory_id for a in prefetcher.advised] == ["a1"]
    # An active model is prefetched into at once, with no activation.
    await s.Advise(advise("a2", "here"), cast(Any, None))
    assert [a.advisory_id for a in prefetcher.advised] == ["a1", "a2"]
    assert activator.activated == ["evicted"]


async def test_an_advisory_ended_while_its_model_loads_prefetches_nothing() -> None:
    s, activator, prefetcher = servicer()
    await s.Advise(advise("a1", "evicted"), cast(Any, None))
    ended = await s.Invalidate(nodemgr_pb2.InvalidateRequest(advisory_id="a1"),
                               cast(Any, None))
    assert ended.found
    activator.loading.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert activator.activated == ["evicted"] and prefetcher.advised == []


async def test_an_advisory_holds_its_model_until_it_is_invalidated_or_replaced() -> None:
    s, activator, _ = servicer()
    await s.Advise(advise("a1", "here"), cast(Any, None))
    assert activator.held == {"a1": "here"}
    await s.Advise(advise("a2", "here"), cast(Any, None))  # (the same session: replaced)
    assert activator.held == {"a2": "here"}
    await s.Invalidate(nodemgr_pb2.InvalidateRequest(advisory_id="a2", expired=True),
                       cast(Any, None))
    assert activator.held == {}
    # A model outside the catalogue is not held (the node does not manage it).
    await s.Advise(advise("a3", "elsewhere"), cast(Any, None))
    assert activator.held == {}
