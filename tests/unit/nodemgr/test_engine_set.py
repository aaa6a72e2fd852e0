"""Which of a node's engines serves a model: a node of one engine hands it every request
until a status has said what it serves (the engine then names its model in its own
NOT_FOUND); after that a model it does not serve is unknown, so a catalogue model is
activated into it rather than refused (the whole-model swap of a one-engine node)."""

from __future__ import annotations

from typing import Any

import pytest

from services.nodemgr.engine_set import EngineSet, UnknownModel
from services.nodemgr.wire import EngineSnapshot
from shared.model_info import ModelInfo


def serving(es: EngineSet, *names: str) -> None:
    """Make each engine's status answer ``names[i]`` ("" = empty)."""
    for link, name in zip(es.links, names, strict=True):
        async def status(saved_after: int = 0, name: str = name) -> EngineSnapshot:
            return EngineSnapshot(models=(ModelInfo(name),) if name else ())
        link_any: Any = link
        link_any.status = status


async def test_one_engine_takes_every_model_until_its_status_is_known() -> None:
    es = EngineSet(["127.0.0.1:1"], 1.0)
    assert es.for_model("beta") is es.links[0]
    serving(es, "alpha")
    await es.status()
    assert es.for_model("alpha") is es.links[0] and es.for_model("") is es.links[0]
    with pytest.raises(UnknownModel):
        es.for_model("beta")
    assert es.served() == ["alpha"]
    serving(es, "")  # evicted: an empty engine serves nothing
    await es.status()
    with pytest.raises(UnknownModel):
        es.for_model("alpha")


async def test_several_engines_each_serve_their_own_model() -> None:
    es = EngineSet(["127.0.0.1:1", "127.0.0.1:2"], 1.0)
    with pytest.raises(UnknownModel):
        es.for_model("alpha")
    serving(es, "alpha", "beta")
    await es.status()
    assert es.for_model("beta") is es.links[1] and es.for_model("alpha") is es.links[0]
    assert es.served() == ["alpha", "beta"]
