"""Symphony §3.4's three memory cases on one node (a real kvstore, an engine with a small
device budget, a 4-layer model), each giving exactly the tokens of recomputation:

1. plenty of free memory: the advised session's whole KV is on device before its request;
2. memory filling during prefetch: a running request makes the engine purge the upper
   layers (never layer 0); the request loads only those, layer-wise, on arrival;
3. no free memory: nothing goes to the device; the KV waits in DRAM and is loaded
   layer-wise on arrival.

Plus: invalidation frees the blocks at once, expiry makes them the first to go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from services.engine.api_types import GenerateRequest, PrefetchStats, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.model import LoadedModel, load_model, write_demo_model
from tests.integration.reuse.harness import (
    TENANT,
    USER_TURNS,
    engine,
    kvstore,
    kvstore_config,
    reference_transcript,
    run_turn,
    saves_settled,
    turn_request,
)

BLOCK_BYTES = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 kv heads of 16 dims, fp32
LAYERS = 4
OTHER = "globex"


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_demo_model(tmp_path_factory.mktemp("model") / "deep", size="tiny-deep")
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(deep: LoadedModel):
    return asyncio.run(reference_transcript(deep, turns=USER_TURNS[:2]))


async def prefetch_stats(eng: AsyncEngine) -> PrefetchStats:
    p = (await eng.status()).reuse.prefetch
    assert p is not None
    return p


async def until(eng: AsyncEngine, ok, timeout_s: float = 20.0) -> PrefetchStats:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        p = await prefetch_stats(eng)
        if ok(p):
            return p
        assert loop.time() < deadline, f"prefetch never got there: {p}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def node(deep: LoadedModel, blocks: int) -> AsyncIterator[AsyncEngine]:
    """A kvstore and an engine whose device holds ``blocks`` blocks (pages of 4)."""
    async with kvstore(kvstore_config(0, None)) as kv, engine(
            deep, kv.address, device_memory_bytes=blocks * BLOCK_BYTES,
            page_bytes=4 * BLOCK_BYTES) as eng:
        yield eng


async def first_turn_stored(eng: AsyncEngine, reference, session: str,
                            tenant: str = TENANT) -> None:
    """Turn 1 of ``session`` runs; its KV lands in the kvstore and leaves the device."""
    msgs, want, _ = reference[0]
    got, _, _ = await run_turn(eng, turn_request(msgs, session, tenant=tenant))
    assert got == want
    await saves_settled(eng)
    await eng.drop_device_cache()


async def second_turn(eng: AsyncEngine, reference, session: str, tenant: str = TENANT) -> str:
    """Turn 2 of ``session``: the tokens of recomputation; where its KV came from."""
    msgs, want, _ = reference[1]
    kv_from = ""
    tokens: list[int] = []
    async for out in eng.generate(turn_request(msgs, session, tenant=tenant)):
        tokens.extend(out.token_ids)
        kv_from = kv_from or out.kv_from
    assert tokens == want, "the second turn differs from recomputation"
    await eng.check_integrity()
    return kv_from


async def test_plenty_of_free_memory_puts_the_whole_kv_on_device(deep, reference) -> None:
    async with node(deep, 256) as eng:
        await first_turn_stored(eng, reference, "s")
        blocks = await eng.prefetch(TENANT, "s")
        assert blocks > 0
        p = await until(eng, lambda p: p.blocks_resident == blocks * LAYERS)
        assert p.loaded_bytes == blocks * LAYERS * BLOCK_BYTES
        assert await second_turn(eng, reference, "s") == "device_prefetched"
        p = await prefetch_stats(eng)
        assert p.outcomes == {"followed": 1} and p.wasted_bytes == 0 and p.sessions == 0


async def test_memory_filling_during_prefetch_purges_upper_layers_first(deep, reference) -> None:
    async with node(deep, 48) as eng:
        await first_turn_stored(eng, reference, "s")
        blocks = await eng.prefetch(TENANT, "s")
        await until(eng, lambda p: p.blocks_resident == blocks * LAYERS)
        # Another session's long prompt needs more than the free blocks: the engine purges
        # the prefetched session's upper layers for it, never its layer 0.
        filler = GenerateRequest(prompt="count " * 110, session_id="other", tenant=TENANT,
                                 sampling=SamplingParams(max_tokens=30, ignore_eos=True))
        task = asyncio.create_task(run_turn(eng, filler))
        p = await until(eng, lambda p: p.purged_blocks_by_layer[LAYERS - 1] > 0)
        assert p.purged_blocks_by_layer[0] == 0
        assert 0 < p.blocks_resident < blocks * LAYERS
        before = (await eng.status()).reuse.loaded_tokens.get("dram", 0)
        # The turn comes while the other request still runs: its lower layers are used as
        # they are, only the purged upper ones are loaded, layer by layer.
        assert await second_turn(eng, reference, "s") == "device_partial"
        assert (await eng.status()).reuse.loaded_tokens.get("dram", 0) > before
        await task


async def test_no_free_memory_stages_in_dram_and_loads_on_arrival(deep, reference) -> None:
    async with node(deep, 48) as eng:
        await first_turn_stored(eng, reference, "s")
        # Another session's long generation holds most of the device: nothing is left for
        # the prefetch beyond what that request needs next.
        filler = GenerateRequest(prompt="go", session_id="busy", tenant=TENANT,
                                 sampling=SamplingParams(max_tokens=186, ignore_eos=True))
        running = asyncio.Event()

        async def generate() -> None:
            n = 0
            async for out in eng.generate(filler):
                n += len(out.token_ids)
                if n >= 170:
                    running.set()

        task = asyncio.create_task(generate())
        await running.wait()
        blocks = await eng.prefetch(TENANT, "s")
        assert blocks > 0
        assert (await prefetch_stats(eng)).blocks_held == 0  # staged in DRAM only
        assert await second_turn(eng, reference, "s") == "local"  # layer-wise from DRAM
        await task


async def test_invalidation_frees_at_once_and_expiry_goes_first(deep, reference) -> None:
    async with node(deep, 256) as eng:
        # (b of another tenant: the same conversation of one tenant has the same hashes,
        # and its blocks would be shared)
        await first_turn_stored(eng, reference, "a")
        await first_turn_stored(eng, reference, "b", tenant=OTHER)
        na = await eng.prefetch(TENANT, "a", ttl_s=0.5)
        nb = await eng.prefetch(OTHER, "b", ttl_s=60)
        await until(eng, lambda p: p.blocks_resident == (na + nb) * LAYERS)
        free_before = (await eng.status()).blocks_free
        eng.end_prefetch(OTHER, "b")  # invalidated
        await until(eng, lambda p: p.outcomes.get("invalidated") == 1)
        assert (await eng.status()).blocks_free == free_before + nb * LAYERS
        await asyncio.sleep(0.6)  # a's TTL passes; the next step expires it
        assert await second_turn(eng, reference, "b", OTHER) == "local"  # DRAM, as unadvised
        p = await until(eng, lambda p: p.outcomes.get("expired") == 1)
        assert p.wasted_bytes == (na + nb) * LAYERS * BLOCK_BYTES and p.sessions == 0
        # a's blocks are the device cache's now, at the front of its eviction order.
        assert (await eng.status()).blocks_evictable >= na * LAYERS


async def test_an_advisory_for_a_session_already_running_here_prefetches_nothing(
        deep, reference) -> None:
    async with node(deep, 256) as eng:
        await first_turn_stored(eng, reference, "s")
        msgs, _, _ = reference[1]
        started = asyncio.Event()

        async def turn() -> None:
            async for _ in eng.generate(turn_request(msgs, "s", n=40)):
                started.set()

        task = asyncio.create_task(turn())
        await started.wait()
        assert await eng.prefetch(TENANT, "s") == 0  # its request came first
        await task
        assert (await prefetch_stats(eng)).sessions == 0
