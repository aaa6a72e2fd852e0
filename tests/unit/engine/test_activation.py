"""An engine outlives its models (Prism §5.2): it starts empty, activates a model, evicts it
and activates another, and each serves what a fresh engine of it serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.errors import INVALID_ARGUMENT, UNAVAILABLE, EngineError
from services.engine.model import write_demo_model
from shared.config import build

from .engine_helpers import PROMPTS, collect, config, greedy, idle, tokens


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return (write_demo_model(root / "alpha", size="tiny", seed=1),
            write_demo_model(root / "beta", size="tiny-deep", seed=2))


async def reference(path: Path) -> list[list[int]]:
    async with AsyncEngine(config(model_path=str(path))) as eng:
        return [tokens(await collect(eng, greedy(p))) for p in PROMPTS[:3]]


async def test_models_take_turns_in_one_engine(two_models: tuple[Path, Path]) -> None:
    alpha, beta = two_models
    want_alpha, want_beta = await reference(alpha), await reference(beta)
    async with AsyncEngine(config(model_path="", standby=True)) as eng:
        st = await eng.status()
        assert st.models == () and st.blocks_total == 0  # on standby, empty
        with pytest.raises(EngineError) as e:
            await collect(eng, greedy("hi"))
        assert e.value.code == UNAVAILABLE
        for path, want, name, layers in ((alpha, want_alpha, "alpha", 2),
                                         (beta, want_beta, "beta", 4),
                                         (alpha, want_alpha, "alpha", 2)):
            info = await eng.activate(str(path))
            assert (info.name, info.num_layers) == (name, layers)
            assert await eng.activate(str(path)) == info  # (the same: nothing to do)
            assert [tokens(await collect(eng, greedy(p))) for p in PROMPTS[:3]] == want
            await idle(eng)
            assert await eng.evict()
        assert not await eng.evict()


async def test_activating_over_another_model_or_a_bad_folder_is_refused(
        two_models: tuple[Path, Path], tmp_path: Path) -> None:
    alpha, beta = two_models
    async with AsyncEngine(config(model_path="", standby=True)) as eng:
        with pytest.raises(EngineError) as e:
            await eng.activate(str(tmp_path / "nothing-here"))
        assert e.value.code == INVALID_ARGUMENT
        await eng.activate(str(alpha))
        with pytest.raises(EngineError) as e:
            await eng.activate(str(beta))
        assert e.value.code == INVALID_ARGUMENT and "evict" in e.value.message
        assert (await eng.status()).models[0].name == "alpha"


async def test_two_activations_at_once_load_one_model(two_models: tuple[Path, Path]) -> None:
    """Two nodemgr activations racing for one empty engine: the first loads its model, the
    second then finds it there and is refused; nothing is loaded twice or leaked."""
    alpha, beta = two_models
    async with AsyncEngine(config(model_path="", standby=True)) as eng:
        results = await asyncio.gather(eng.activate(str(alpha)), eng.activate(str(beta)),
                                       return_exceptions=True)
        assert results[0].name == "alpha"  # type: ignore[union-attr]
        assert isinstance(results[1], EngineError) and results[1].code == INVALID_ARGUMENT
        assert (await eng.status()).models[0].name == "alpha"
        await idle(eng)
        assert await eng.evict() and (await eng.status()).models == ()


async def test_status_answers_while_a_model_is_switched(two_models: tuple[Path, Path]) -> None:
    """Between models (an activation or eviction under way) the engine answers Status as
    one without a model; before, it answered UNAVAILABLE and its nodemgr reported the
    node unable to serve in the middle of every swap."""
    alpha, _ = two_models
    async with AsyncEngine(config(model_path="", standby=True)) as eng:
        seen: list[tuple[str, ...]] = []

        async def poll(task: asyncio.Future) -> None:
            while not task.done():
                seen.append(tuple(m.name for m in (await eng.status()).models))
                await asyncio.sleep(0)

        for switch in (lambda: eng.activate(str(alpha)), eng.evict):
            task = asyncio.ensure_future(switch())
            await poll(task)
            await task
        assert seen and set(seen) <= {(), ("alpha",)}


def test_the_old_pool_key_still_means_standby() -> None:
    """``engine.pool`` (before the KV pool was an engine's only pool) is accepted for a
    release, as ``engine.standby``."""
    assert build(EngineConfig, {"pool": True}).standby
    assert build(EngineConfig, {"pool": "true", "model_path": "m"}).standby
    assert not build(EngineConfig, {}).standby
