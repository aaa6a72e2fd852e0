"""Two engines, two models, one node budget (Prism §5.1): a burst on model B takes the
pages model A no longer uses, and gives them back when A's traffic returns; no restart,
and both still produce what an engine of their own produces."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.model import write_demo_model
from services.engine.model_slot import weight_bytes
from services.nodemgr.memory_broker import EngineMemory, MemoryBroker, to_reclaim
from shared.device_ledger import DeviceLedger, create_ledger

from .engine_helpers import collect, config, tokens

PAGE = 16 << 10
LONG = [" ".join(f"word{i} item{j}" for j in range(90)) for i in range(4)]


def req(prompt: str) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=8,
                                                                  ignore_eos=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return (write_demo_model(root / "alpha", size="tiny", seed=1),
            write_demo_model(root / "beta", size="tiny-deep", seed=2))


async def burst(eng: AsyncEngine, prompts: list[str]) -> list[list[int]]:
    outs = await asyncio.gather(*(collect(eng, req(p)) for p in prompts))
    return [tokens(o) for o in outs]


async def alone(models: tuple[Path, Path], for_a: list[str], for_b: list[str]
                ) -> tuple[list[list[int]], list[list[int]], int]:
    """What each model produces on an engine of its own (the reference), and the bytes of
    both models' weights."""
    async with AsyncEngine(config(model_path=str(models[0]))) as a, \
            AsyncEngine(config(model_path=str(models[1]))) as b:
        return (await burst(a, for_a), await burst(b, for_b),
                weight_bytes(a.loaded.model) + weight_bytes(b.loaded.model))


def test_the_broker_reclaims_from_idle_engines_only_for_waiting_ones() -> None:
    busy = EngineMemory("b", running=2, waiting=3, committed_blocks=40)
    idle = EngineMemory("a", running=0, waiting=0, committed_blocks=40)
    empty = EngineMemory("c", running=0, waiting=0, committed_blocks=0)
    assert to_reclaim([busy, idle, empty]) == ["a"]
    assert to_reclaim([EngineMemory("b", 2, 0, 40), idle]) == []  # nobody waits
    # A busy engine gives up its free and cached pages to one that waits, too.
    running = EngineMemory("r", running=3, waiting=0, committed_blocks=40)
    assert to_reclaim([busy, running, idle]) == ["r", "a"]


async def test_the_broker_polls_an_idle_node_seldom_and_a_busy_one_every_round() -> None:
    polls: list[int] = []
    in_flight = [0]

    async def poll() -> list[EngineMemory]:
        polls.append(in_flight[0])
        return [EngineMemory("a", in_flight[0], 0, 4)]

    async def shrink(name: str, pages: int) -> int:
        raise AssertionError("nothing waits")

    broker = MemoryBroker(poll, shrink, interval_s=0.01, busy=lambda: in_flight[0] > 0,
                          idle_interval_s=10.0)
    assert broker.due(0.0)  # the first round runs whatever the load
    await broker.balance()
    last = broker._last_round
    assert not broker.due(last + 5.0) and broker.due(last + 10.0)  # idle: every 10 s
    in_flight[0] = 1
    assert broker.due(last + 0.01)  # a request in the node: every round
    balancing = asyncio.create_task(broker.run())
    await asyncio.sleep(0.2)
    in_flight[0] = 0
    busy_rounds = broker.rounds
    await asyncio.sleep(0.2)
    balancing.cancel()
    assert busy_rounds >= 5 and broker.rounds == busy_rounds  # none while idle
    assert all(p == 1 for p in polls[1:])


async def test_a_burst_takes_idle_pages_and_gives_them_back(models: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    alpha, beta = models
    want_a, want_b, weights = await alone(models, LONG, LONG[:2])
    # Room for the weights and 48 KV pages: alpha's burst holds ~40 of them when done
    # (its prefix cache), beta's two requests need ~40 (4 layers): not both at once.
    path = create_ledger(tmp_path / "ledger", weights + 48 * PAGE)
    kw = {"device_memory_bytes": 48 * PAGE, "page_bytes": PAGE, "device_ledger": str(path)}
    async with AsyncEngine(config(model_path=str(alpha), **kw)) as a, \
            AsyncEngine(config(model_path=str(beta), **kw)) as b:
        engines = {"alpha": a, "beta": b}

        async def poll() -> list[EngineMemory]:
            out = []
            for name, eng in engines.items():
                st = await eng.status()
                out.append(EngineMemory(name, st.running, st.waiting, st.blocks_committed))
            return out

        async def shrink(name: str, pages: int) -> int:
            return await engines[name].shrink_kv(pages)

        broker = MemoryBroker(poll, shrink, interval_s=0.02)
        ledger = DeviceLedger(path)
        balancing = asyncio.create_task(broker.run())
        try:
            assert await burst(a, LONG) == want_a
            held_by_a = (await a.status()).blocks_committed
            assert held_by_a * 4096 >= 30 * PAGE  # (pages stay with idle A until asked)
            assert await burst(b, LONG[:2]) == want_b  # B waited for A's pages, then ran
            assert broker.reclaimed_pages > 0
            # Its wait over, B is idle: it takes no steps (it once kept waking for ever).
            steps = b._require_core().steps
            await asyncio.sleep(0.3)
            assert b._require_core().steps - steps <= 1
            assert (await a.status()).blocks_committed < held_by_a
            before = broker.reclaimed_pages
            assert await burst(a, LONG) == want_a  # A's traffic returns: B gives them back
            assert broker.reclaimed_pages > before
            assert ledger.used_bytes() <= ledger.budget_bytes
            labels = {h.label for h in ledger.holders()}
            assert labels == {"alpha", "beta"}
        finally:
            balancing.cancel()
            ledger.close()
    assert DeviceLedger(path).used_bytes() == 0  # both engines gave everything back


async def test_a_reserve_lets_a_model_start_while_another_holds_the_rest(
        models: tuple[Path, Path], tmp_path: Path) -> None:
    """Prism §6.3's buffer per engine: B reserves room for a request. A's burst takes all
    it may (its prefix cache keeps it after), yet B's request then runs at once with no
    broker to reclaim for it; a reclaim leaves B its reserve; outputs are unchanged."""
    alpha, beta = models
    want_a, want_b, weights = await alone(models, LONG, LONG[:1])
    # Room for 64 KV pages: B's request needs ~39 (4 layers), A's ~17 each.
    path = create_ledger(tmp_path / "ledger", weights + 64 * PAGE)
    kw = {"device_memory_bytes": 64 * PAGE, "page_bytes": PAGE, "device_ledger": str(path)}
    async with AsyncEngine(config(model_path=str(alpha), **kw)) as a, \
            AsyncEngine(config(model_path=str(beta), kv_reserve_bytes=40 * PAGE, **kw)) as b:
        ledger = DeviceLedger(path)
        try:
            assert await burst(a, LONG) == want_a
            assert ledger.used_bytes() - weights <= 24 * PAGE  # A stopped at B's reserve
            assert await asyncio.wait_for(burst(b, LONG[:1]), 10.0) == want_b
            st = await b.status()
            held = st.blocks_committed
            assert await b.shrink_kv(1 << 20) == 0 and held * st.block_bytes <= 40 * PAGE
            assert (await b.status()).blocks_committed == held  # kept: it is the reserve
        finally:
            ledger.close()
