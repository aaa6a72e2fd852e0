"""Our side of ``bench.engine.speed``: the in-process AsyncEngine on the batches of
speed_workload.py, and the paired extras (the all-decode fast path on and off, constrained
decoding, log-probabilities and penalties). Services are imported inside the functions, so
that the transformers side's process never loads them (its peak RSS is its own)."""

from __future__ import annotations

import asyncio
import time

from bench.engine.speed_workload import BATCHES, prompts

# No sequence can finish before ``gen`` tokens: at least 400 strings to write.
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 400}


async def _ours_batch(engine, batch: list[list[int]], gen: int,
                      schema: dict | None = None, processed: bool = False
                      ) -> tuple[float, float]:
    from services.engine.api_types import GenerateRequest, Guidance, SamplingParams

    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    if processed:
        sp = SamplingParams(max_tokens=gen, ignore_eos=True, **PROCESSED)
    guide = Guidance(response_format="json_schema", json_schema=schema) if schema else Guidance()
    firsts: list[float] = []
    counts: list[int] = []

    async def one(ids: list[int]) -> None:
        got_first = False
        n = 0
        req = GenerateRequest(prompt_token_ids=tuple(ids), sampling=sp, guidance=guide)
        async for out in engine.generate(req):
            n += len(out.token_ids)
            if not got_first:
                firsts.append(time.perf_counter())
                got_first = True
        counts.append(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in batch))
    t_end = time.perf_counter()
    t_first = max(firsts)
    assert all(n == gen for n in counts), f"a sequence ended early: {counts}"
    return t_first - t0, t_end - t_first


async def _constrained(eng, prompt_len: int, gen: int, vocab: int) -> tuple[float, float]:
    """Decode tok/s of a batch of 8: unconstrained, then with LONG_SCHEMA (best of 2)."""
    batch = prompts(8, prompt_len, vocab, seed=7)
    free, guided = 0.0, 0.0
    for _ in range(2):
        _, t = await _ours_batch(eng, batch, gen)
        free = max(free, 8 * (gen - 1) / t)
        _, t = await _ours_batch(eng, batch, gen, LONG_SCHEMA)
        guided = max(guided, 8 * (gen - 1) / t)
    return free, guided


PROCESSED = {"logprobs": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5,
             "repetition_penalty": 1.1, "logit_bias": ((20, 1.0), (21, -1.0))}
REPEATS = 20  # interleaved pairs: single pairs on a 2-core host vary by ±20%


async def _processed(eng, prompt_len: int, gen: int, vocab: int) -> list[float]:
    """Decode cost of PROCESSED on a batch of 8, per interleaved pair (plain first, then
    processed, the same prompts): 1 - processed tok/s / plain tok/s."""
    batch = prompts(8, prompt_len, vocab, seed=11)
    costs = []
    for _ in range(REPEATS):
        _, t_plain = await _ours_batch(eng, batch, gen)
        _, t_done = await _ours_batch(eng, batch, gen, processed=True)
        costs.append(1 - t_plain / t_done)  # 1 - (tok/s processed) / (tok/s plain)
    return costs


async def _fast_decode_pairs(eng, prompt_len: int, gen: int, vocab: int,
                             pairs: int) -> tuple[list[float], list[float]]:
    """Batch-1 decode tok/s with the all-decode fast path (model/decode_step.py) and with
    the general path, in ``pairs`` interleaved pairs on the same prompt (issue 44)."""
    model = eng.loaded.model
    batch = prompts(1, prompt_len, vocab, seed=13)
    fast: list[float] = []
    general: list[float] = []
    for _ in range(pairs):
        for on, into in ((True, fast), (False, general)):
            model.fast_decode = on  # (between requests: the worker thread is idle)
            _, t = await _ours_batch(eng, batch, gen)
            into.append((gen - 1) / t)
    model.fast_decode = True
    return fast, general


async def run_ours(model: str, prompt_len: int, gen: int, dtype: str, extras: bool,
                pairs: int = 0) -> dict:
    from services.engine.async_engine import AsyncEngine
    from services.engine.config import EngineConfig

    cfg = EngineConfig(
        model_path=model,
        dtype=dtype,
        device_memory_bytes=2 << 30,
        max_num_seqs=64,
        max_num_batched_tokens=max(BATCHES) * prompt_len,
        max_queue_delay_s=0.0,  # a closed batch: measure the steps, not the admission
    )
    from services.engine.model_slot import weight_bytes

    out: dict = {}
    async with AsyncEngine(cfg) as eng:
        assert eng.loaded is not None
        vocab = eng.loaded.config.vocab_size
        out["weights"] = weight_bytes(eng.loaded.model)
        kv = 0  # the KV pool's committed bytes, its high-water over the runs
        await _ours_batch(eng, prompts(1, prompt_len, vocab, seed=99), 4)  # warm-up
        for b in BATCHES:
            # Fresh prompts per batch size, and the prefix cache cannot help: ids differ.
            t_pre, t_dec = await _ours_batch(eng, prompts(b, prompt_len, vocab), gen)
            out[b] = (b * prompt_len / t_pre, b * (gen - 1) / t_dec)
            st = await eng.status()
            kv = max(kv, st.blocks_committed * st.block_bytes)
        out["kv"] = kv
        # what the process holds resident now, serving, by part (engine/process_memory.py)
        from services.engine.process_memory import breakdown

        out["resident"] = breakdown()
        if pairs:
            out["fast_decode"] = await _fast_decode_pairs(eng, prompt_len, gen, vocab, pairs)
        if extras:
            out["constrained"] = await _constrained(eng, prompt_len, gen, vocab)
            out["processed"] = await _processed(eng, prompt_len, gen, vocab)
    return out
