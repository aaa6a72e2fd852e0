"""Edited history, a system prompt shared by sessions, identical prompts under load."""

from __future__ import annotations

import asyncio

from services.engine.api_types import ChatMessage, GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.engine_core import EngineCore
from services.engine.model import LoadedModel
from services.engine.validation import prepare
from tests.integration.reuse.harness import (
    SYSTEM,
    engine,
    engine_config,
    kvstore,
    kvstore_config,
    reference_transcript,
    run_turn,
    saves_settled,
    turn_request,
)

TURNS = ["Tell me a story about a robot that learns to paint.", "Why is the sky blue?",
         "What is the capital of France?"]


def prompt_ids(loaded: LoadedModel, msgs: list[ChatMessage]) -> list[int]:
    return loaded.tokenizer.encode_chat(
        [{"role": m.role, "content": m.content} for m in msgs], add_generation_prompt=True
    )


async def test_edited_history_reuses_up_to_the_first_differing_block(
    loaded: LoadedModel,
) -> None:
    ref = await reference_transcript(loaded, TURNS)
    msgs3 = list(ref[2][0])
    edited = list(msgs3)
    assert edited[3].role == "user"
    edited[3] = ChatMessage("user", edited[3].content.replace("sky", "sea"))
    # What recomputation gives for the edited history, and for regenerating turn 3.
    async with engine(loaded, mode="recompute") as eng:
        want_edit = (await run_turn(eng, turn_request(edited, "x")))[0]
    first_diff = next(
        i for i, (a, b) in enumerate(zip(prompt_ids(loaded, msgs3), prompt_ids(loaded, edited),
                                         strict=False)) if a != b
    )
    async with kvstore(kvstore_config(0, None)) as kv, engine(loaded, kv.address) as eng:
        for msgs, want, _ in ref:
            assert (await run_turn(eng, turn_request(msgs, "e")))[0] == want
        for msgs, want in ((edited, want_edit), (msgs3, ref[2][1])):  # edit, then regenerate
            await saves_settled(eng)
            await eng.drop_device_cache()
            got, _, cached = await run_turn(eng, turn_request(msgs, "e"))
            assert got == want
            assert cached > 0
            if msgs is edited:
                assert cached <= first_diff // 16 * 16  # stops at the first differing block
        await eng.check_integrity()


def test_sessions_sharing_a_system_prompt_share_its_device_blocks(loaded: LoadedModel) -> None:
    core = EngineCore(engine_config(), loaded)
    try:
        def add(rid: str, user: str, session: str) -> None:
            req = GenerateRequest(
                request_id=rid, session_id=session,
                messages=(ChatMessage("system", SYSTEM * 3), ChatMessage("user", user)),
                sampling=SamplingParams(max_tokens=50, ignore_eos=True),
            )
            core.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                             vocab_size=loaded.config.vocab_size,
                             max_model_len=core.max_model_len, fingerprint=loaded.fingerprint))

        add("a", "Why is the sky blue?", "s1")
        while core._live["a"].seq.num_computed_tokens < core._live["a"].seq.num_prompt_tokens:
            core.step()
        add("b", "What is the capital of France?", "s2")
        outs = core.step()
        a, b = core._live["a"].seq, core._live["b"].seq
        shared = b.num_cached_tokens // 16
        system_blocks = len(prompt_ids(loaded, [ChatMessage("system", SYSTEM * 3)])) // 16
        assert shared >= system_blocks - 1 > 0
        assert b.num_cached_tokens == next(o for o in outs if o.request_id == "b").cached_tokens
        for layer in range(loaded.config.num_layers):
            assert b.block_tables[layer][:shared] == a.block_tables[layer][:shared]
        core.check_integrity()
    finally:
        core.abort_all()
        core.close()


async def _burst(eng: AsyncEngine, req: GenerateRequest, n: int) -> list[list[int]]:
    outs = await asyncio.gather(*(run_turn(eng, req) for _ in range(n)))
    return [o[0] for o in outs]


async def test_identical_prompts_under_concurrent_load(loaded: LoadedModel) -> None:
    msgs = [ChatMessage("system", SYSTEM * 2), ChatMessage("user", "Count to ten.")]
    req = turn_request(msgs, "burst", n=12)
    async with engine(loaded, mode="recompute") as eng:
        base = await _burst(eng, req, 6)
    assert all(o == base[0] for o in base)
    async with kvstore(kvstore_config(0, None)) as kv, engine(loaded, kv.address) as eng:
        first = await _burst(eng, req, 1)  # saves the prompt's KV
        await saves_settled(eng)
        await eng.drop_device_cache()
        loaded_burst = await _burst(eng, req, 6)  # all load from DRAM (or hit the device)
        device_burst = await _burst(eng, req, 6)
        st = (await eng.status()).reuse
        assert st.loaded_tokens.get("dram", 0) > 0 and st.device_tokens > 0
        await saves_settled(eng)
        await eng.check_integrity()
    assert first == [base[0]] and loaded_burst == base and device_burst == base
