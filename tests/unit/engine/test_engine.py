"""The in-process AsyncEngine on the tiny demo model in float32 (exact token equality)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path

import pytest

from services.engine.api_types import ChatMessage, GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.errors import EngineError
from services.engine.model import LoadedModel
from tests.unit.engine.engine_helpers import (
    PROMPTS,
    collect,
    config,
    engine,
    greedy,
    idle,
    tokens,
)


async def test_stream_shape_and_usage(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        outs = await collect(eng, greedy(PROMPTS[0], 5))
        await idle(eng)
    first, last = outs[0], outs[-1]
    assert first.prompt_token_ids and first.prompt_tokens == len(first.prompt_token_ids)
    assert all(not o.prompt_token_ids for o in outs[1:])
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert last.completion_tokens == 5 and len(tokens(outs)) == 5
    assert "".join(o.text for o in outs) == loaded.tokenizer.decode(tokens(outs))


async def test_batched_equals_one_at_a_time(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        alone = [tokens(await collect(eng, greedy(p))) for p in PROMPTS]
        together = await asyncio.gather(*(collect(eng, greedy(p)) for p in PROMPTS))
        await idle(eng)
    assert [tokens(o) for o in together] == alone


async def test_chunked_prefill_equals_full_prefill(loaded: LoadedModel) -> None:
    long = " ".join(PROMPTS)
    async with engine(loaded) as eng:
        full = tokens(await collect(eng, greedy(long, 16)))
    async with engine(loaded, max_num_batched_tokens=16) as eng:
        reqs = [greedy(long, 16), greedy(PROMPTS[2], 16)]
        chunked = await asyncio.gather(*(collect(eng, r) for r in reqs))
        await idle(eng)
    assert len(chunked[0][0].prompt_token_ids) > 3 * 16  # really chunked
    assert tokens(chunked[0]) == full


async def test_preempted_requests_resume_with_the_same_tokens(loaded: LoadedModel) -> None:
    reqs = [greedy(p, 40) for p in PROMPTS[:4]]
    async with engine(loaded) as eng:
        undisturbed = [tokens(await collect(eng, r)) for r in reqs]
    # 16 blocks of 4 KiB = 8 per layer = 128 tokens: four 60-token requests cannot coexist.
    async with engine(loaded, device_memory_bytes=64 << 10, page_bytes=4096) as eng:
        squeezed = await asyncio.gather(*(collect(eng, r) for r in reqs))
        st = await eng.status()
        await idle(eng)
    assert st.preemptions > 0
    assert [tokens(o) for o in squeezed] == undisturbed


async def test_prefix_cache_hit_gives_the_same_tokens(loaded: LoadedModel) -> None:
    prompt = " ".join(PROMPTS[:4])
    async with engine(loaded) as eng:
        cold = await collect(eng, greedy(prompt, 10))
        warm = await collect(eng, greedy(prompt, 10))
        other_tenant = await collect(eng, greedy(prompt, 10, tenant="t2"))
        await idle(eng)
    n = cold[0].prompt_tokens
    assert cold[-1].cached_tokens == 0
    assert warm[-1].cached_tokens == (n - 1) // 16 * 16 > 0
    assert other_tenant[-1].cached_tokens == 0  # tenants never share KV
    assert tokens(warm) == tokens(cold) == tokens(other_tenant)


async def test_cancel_frees_blocks(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        gen = eng.generate(greedy(PROMPTS[2], 500))
        first = await gen.__anext__()
        assert first.finish_reason is None
        st = await eng.status()
        assert st.running == 1 and st.blocks_used > 0
        await gen.aclose()
        await idle(eng)


async def test_cancelled_task_aborts(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in eng.generate(greedy(PROMPTS[2], 500)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await idle(eng)


async def test_explicit_abort_ends_the_stream(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        gen = eng.generate(greedy(PROMPTS[1], 500, request_id="r-abort"))
        await gen.__anext__()
        assert await eng.abort("r-abort")
        rest = [o async for o in gen]
        assert rest[-1].finish_reason == "abort"
        await idle(eng)


async def test_stop_string_from_the_greedy_output(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        base = await collect(eng, greedy(PROMPTS[3], 24))
        text = "".join(o.text for o in base)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip()
        req = GenerateRequest(
            prompt=PROMPTS[3], sampling=SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
        )
        outs = await collect(eng, req)
        await idle(eng)
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == text[: text.find(stop)]


async def test_seeded_sampling_is_reproducible(loaded: LoadedModel) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=123, ignore_eos=True)
    async with engine(loaded) as eng:
        a = tokens(await collect(eng, GenerateRequest(prompt=PROMPTS[0], sampling=p)))
        b = tokens(await collect(eng, GenerateRequest(prompt=PROMPTS[0], sampling=p)))
    assert a == b


async def test_chat_and_token_id_inputs(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode_prompt(PROMPTS[0])
    msgs = (ChatMessage("user", "Hi there"),)
    async with engine(loaded) as eng:
        by_text = tokens(await collect(eng, greedy(PROMPTS[0], 6)))
        by_ids = tokens(
            await collect(
                eng,
                GenerateRequest(
                    prompt_token_ids=tuple(ids),
                    sampling=SamplingParams(max_tokens=6, ignore_eos=True),
                ),
            )
        )
        chat = await collect(
            eng, GenerateRequest(messages=msgs, sampling=SamplingParams(max_tokens=4))
        )
    assert by_ids == by_text
    assert chat[0].prompt_token_ids == tuple(
        loaded.tokenizer.encode_chat([{"role": "user", "content": "Hi there"}])
    )


@pytest.mark.parametrize(
    "req, code, words",
    [
        (GenerateRequest(prompt=""), "invalid_argument", "empty"),
        (GenerateRequest(), "invalid_argument", "exactly one"),
        (GenerateRequest(prompt="x", prompt_token_ids=(1,)), "invalid_argument", "exactly one"),
        (GenerateRequest(prompt_token_ids=(1, 10**6)), "invalid_argument", "vocabulary"),
        (GenerateRequest(prompt_token_ids=(1,) * 300), "invalid_argument", "context limit"),
        (
            GenerateRequest(prompt="hi", sampling=SamplingParams(max_tokens=10**6)),
            "invalid_argument",
            "max_tokens",
        ),
        (
            GenerateRequest(prompt="hi", sampling=SamplingParams(top_p=0.0)),
            "invalid_argument",
            "top_p",
        ),
        (
            GenerateRequest(prompt="hi", sampling=SamplingParams(temperature=-1)),
            "invalid_argument",
            "temperature",
        ),
        (GenerateRequest(prompt="hi", model="nope"), "not_found", "nope"),
    ],
)
async def test_bad_requests_get_typed_errors(
    loaded: LoadedModel, req: GenerateRequest, code: str, words: str
) -> None:
    async with engine(loaded, max_model_len=256) as eng:
        with pytest.raises(EngineError) as e:
            await collect(eng, req)
        assert e.value.code == code and words in e.value.message
        await idle(eng)


async def test_queue_bound_is_resource_exhausted(loaded: LoadedModel) -> None:
    # One running (max_num_seqs=1) and one waiting fill the queue whatever the timing: a
    # third request is refused.
    async with engine(loaded, max_waiting=1, max_num_seqs=1) as eng:
        first = eng.generate(greedy(PROMPTS[0], 400))
        await first.__anext__()  # running
        second = eng.generate(greedy(PROMPTS[1], 4))
        head = asyncio.ensure_future(second.__anext__())
        while (await eng.status()).waiting < 1:  # admitted to the queue, not to the batch
            assert not head.done()
            await asyncio.sleep(0.005)
        with pytest.raises(EngineError) as e:
            await eng.generate(greedy(PROMPTS[2], 4)).__anext__()
        assert e.value.code == "resource_exhausted"
        await first.aclose()
        await head
        await second.aclose()
        await idle(eng)


async def test_status_and_kv_shrink(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        st = await eng.status()
        assert st.models[0].name == loaded.name and st.models[0].fingerprint == loaded.fingerprint
        assert st.blocks_committed == 0 and st.blocks_free == st.blocks_total
        await collect(eng, greedy(" ".join(PROMPTS), 8))
        st = await eng.status()
        assert st.blocks_committed > 0 and st.blocks_evictable > 0
        released = await eng.shrink_kv(10**6)
        st2 = await eng.status()
        assert released > 0 and st2.blocks_committed == 0 and st2.blocks_evictable == 0
        assert Path(st.pool_name).exists()
    assert not Path(st.pool_name).exists()  # stop() removed the shared-memory file


async def test_missing_model_path_says_how_to_make_one() -> None:
    from shared.config import ConfigError

    with pytest.raises(ConfigError, match="overture demo-model"):
        async with AsyncEngine(EngineConfig(model_path="")):
            pass


def test_config_replace_is_frozen() -> None:
    cfg = config()
    assert replace(cfg, block_size=8).block_size == 8


async def test_a_running_requests_blocks_are_shared_by_a_later_identical_prompt(
    loaded: LoadedModel,
) -> None:
    prompt = " ".join(PROMPTS[:3])
    async with engine(loaded) as eng:
        first = eng.generate(greedy(prompt, 30))
        head = [await first.__anext__()]
        second = await collect(eng, greedy(prompt, 30))  # while the first still runs
        rest = [o async for o in first]
        await idle(eng)
    assert second[-1].cached_tokens > 0
    assert tokens(second) == tokens(head + rest)


class SlowLookups:
    """A reuse planner whose kvstore lookup takes a while and finds nothing (no plan)."""

    async def plan(self, req: object) -> None:
        await asyncio.sleep(0.2)

    def release(self, plan: object) -> None:
        raise AssertionError("no plan was made")


async def test_a_request_id_in_use_is_refused_even_while_its_lookup_runs(loaded) -> None:
    """The id is claimed before the lookup: a retry with the same id is refused, and the
    first request and a bystander finish exactly as on their own."""
    async with engine(loaded) as eng:
        alone = tokens(await collect(eng, greedy(PROMPTS[0], 20)))
        eng._slot.planner = SlowLookups()
        first = asyncio.create_task(collect(eng, greedy(PROMPTS[0], 20, request_id="same")))
        bystander = asyncio.create_task(collect(eng, greedy(PROMPTS[7], 10)))
        await asyncio.sleep(0.05)  # the first one's lookup is in flight
        with pytest.raises(EngineError, match="already running"):
            await collect(eng, greedy(PROMPTS[2], 20, request_id="same"))
        assert tokens(await asyncio.wait_for(first, 60)) == alone
        assert len(tokens(await asyncio.wait_for(bystander, 60))) == 10
        eng._slot.planner = None
        await idle(eng)


async def test_a_request_whose_lookup_runs_across_a_stop_ends_unavailable(loaded) -> None:
    eng = AsyncEngine(config(), loaded=loaded)
    await eng.start()
    eng._slot.planner = SlowLookups()
    pending = asyncio.create_task(collect(eng, greedy(PROMPTS[1], 4)))
    await asyncio.sleep(0.05)
    await eng.stop()
    with pytest.raises(EngineError, match="shutting down"):
        await asyncio.wait_for(pending, 5)


async def test_a_request_aborted_during_its_lookup_ends_aborted(loaded) -> None:
    async with engine(loaded) as eng:
        eng._slot.planner = SlowLookups()
        pending = asyncio.create_task(collect(eng, greedy(PROMPTS[0], 20, request_id="r")))
        await asyncio.sleep(0.05)
        assert await eng.abort("r")
        outs = await asyncio.wait_for(pending, 5)
        assert outs[-1].finish_reason == "abort" and not tokens(outs)
        eng._slot.planner = None
        assert len(tokens(await collect(eng, greedy(PROMPTS[0], 4, request_id="r")))) == 4
        await idle(eng)


async def test_a_no_reuse_request_recomputes_everything(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        first = await collect(eng, greedy(PROMPTS[2], 6))
        again = await collect(eng, greedy(PROMPTS[2], 6))
        assert again[-1].cached_tokens > 0  # the device prefix cache serves the repeat ...
        baseline = await collect(eng, greedy(PROMPTS[2], 6, no_reuse=True))
        assert baseline[-1].cached_tokens == 0  # ... but not a no_reuse (baseline) request
        assert tokens(baseline) == tokens(first) == tokens(again)
        await idle(eng)


class NoLookups:
    """A reuse planner that must not be asked (a device_only request has no tiers)."""

    async def plan(self, req: object) -> None:
        raise AssertionError("a device_only request asked the kvstore")

    def release(self, plan: object) -> None:
        raise AssertionError("no plan was made")


async def test_a_device_only_request_reuses_the_device_cache_and_no_tier(
        loaded: LoadedModel) -> None:
    """The ``prefix`` baseline: KV only in device memory. The repeat is served from the
    device prefix cache, with the same tokens, and the kvstore is never asked."""
    async with engine(loaded) as eng:
        first = await collect(eng, greedy(PROMPTS[2], 6))
        eng._slot.planner = NoLookups()
        again = await collect(eng, greedy(PROMPTS[2], 6, device_only=True))
        assert again[-1].cached_tokens > 0
        assert tokens(again) == tokens(first)
        eng._slot.planner = None
        await idle(eng)
