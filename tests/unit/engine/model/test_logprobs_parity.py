"""Log-probabilities and the logits processors of the whole engine against transformers on
the same random weights (fp32): greedy top_logprobs equal log_softmax of the reference's
logits, echo's prompt log-probabilities too (with a cached prefix on device or not), and
each penalty and logit_bias equals the hand-computed distribution at every step."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from services.engine.api_types import GenerateOutput, GenerateRequest, SamplingParams
from services.engine.model import load_model
from tests.unit.engine.engine_helpers import collect, engine, tokens

TOL = 1e-4
PROMPT = [7, 99, 311, 42, 8, 560, 77, 901, 12, 13, 14, 300, 5, 6, 401, 402, 403, 19, 20]


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()  # (len, vocab)


def _gen(sampling: SamplingParams, prompt: list[int] = PROMPT) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=tuple(prompt), sampling=sampling)


def _lps(outs: list[GenerateOutput]):
    return [t for o in outs for t in o.logprobs]


@pytest.fixture
def checkpoint(hf_checkpoint):
    folder, ref = hf_checkpoint(arch="llama")
    return load_model(folder, dtype=torch.float32), ref


def test_greedy_top_logprobs_match_reference(checkpoint) -> None:
    loaded, ref = checkpoint

    async def run():
        async with engine(loaded) as eng:
            return await collect(eng, _gen(SamplingParams(max_tokens=10, ignore_eos=True,
                                                          logprobs=5)))

    outs = asyncio.run(run())
    out_ids = tokens(outs)
    entries = _lps(outs)
    assert len(entries) == len(out_ids) == 10
    want = _ref_logits(ref, PROMPT + out_ids).log_softmax(-1)
    for i, (tok, e) in enumerate(zip(out_ids, entries, strict=True)):
        row = want[len(PROMPT) - 1 + i]
        assert e.token_id == tok and abs(e.logprob - row[tok].item()) < TOL
        ref_top = row.topk(5)
        assert [t.token_id for t in e.top] == ref_top.indices.tolist()
        for t, v in zip(e.top, ref_top.values.tolist(), strict=True):
            assert abs(t.logprob - v) < TOL
        assert tok in [t.token_id for t in e.top]  # temperature 0: the sampled is the top
        assert e.raw and e.top[0].raw


def _echo_sum(outs: list[GenerateOutput], start: int) -> float:
    prompt = outs[0].prompt_logprobs
    assert len(prompt) == len(PROMPT) and prompt[0].logprob is None
    assert [p.token_id for p in prompt] == PROMPT
    return sum(p.logprob for p in prompt[start:])


def test_echo_logprobs_sum_matches_reference_with_and_without_cached_kv(checkpoint) -> None:
    """lm-evaluation-harness scoring: the continuation's log-likelihood from echo."""
    loaded, ref = checkpoint
    lp = _ref_logits(ref, PROMPT).log_softmax(-1)
    start = 11  # context PROMPT[:11], continuation PROMPT[11:]
    want = sum(lp[p - 1, PROMPT[p]].item() for p in range(start, len(PROMPT)))
    echo = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=1, prompt_logprobs=1)

    async def run():
        # Small chunks: the prompt's positions come over several prefill steps.
        async with engine(loaded, max_num_batched_tokens=8) as eng:
            cold = await collect(eng, _gen(echo))
            plain = SamplingParams(max_tokens=2, ignore_eos=True)
            await collect(eng, _gen(plain))
            warm = await collect(eng, _gen(plain))  # the prefix is cached on device now
            reused = await collect(eng, _gen(echo))
            return cold, warm, reused

    cold, warm, reused = asyncio.run(run())
    assert warm[0].cached_tokens > 0
    assert reused[0].cached_tokens == 0  # echo computes every prompt position (docs/api.md)
    for outs in (cold, reused):
        assert abs(_echo_sum(outs, start) - want) < TOL * len(PROMPT)
        assert all(abs(p.logprob - lp[i - 1, PROMPT[i]].item()) < TOL
                   for i, p in enumerate(outs[0].prompt_logprobs) if i)


def _hand(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams
          ) -> torch.Tensor:
    """The processed logits, element by element from the definitions."""
    x = logits.clone().tolist()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt + out):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return torch.tensor(x)


PROCESSED = {
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=0.7),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "logit_bias": SamplingParams(logit_bias=((5, 3.0), (300, -100.0), (640, 8.5))),
    "all": SamplingParams(presence_penalty=-0.5, frequency_penalty=1.2,
                          repetition_penalty=1.3, logit_bias=((17, 4.0),)),
}


@pytest.mark.parametrize("case", list(PROCESSED))
def test_processors_match_hand_computed_distribution(checkpoint, case: str) -> None:
    loaded, ref = checkpoint
    base = PROCESSED[case]
    params = SamplingParams(**{**base.__dict__, "max_tokens": 12, "ignore_eos": True,
                               "logprobs": 20})

    async def run():
        async with engine(loaded) as eng:
            return await collect(eng, _gen(params))

    outs = asyncio.run(run())
    out_ids = tokens(outs)
    raw = _ref_logits(ref, PROMPT + out_ids)
    for i, (tok, e) in enumerate(zip(out_ids, _lps(outs), strict=True)):
        hand = _hand(raw[len(PROMPT) - 1 + i], PROMPT, out_ids[:i], params).log_softmax(-1)
        assert tok == int(hand.argmax())
        assert abs(e.logprob - hand[tok].item()) < TOL
        for t in e.top:
            assert abs(t.logprob - max(hand[t.token_id].item(), -9999.0)) < TOL


def test_min_p_one_keeps_only_the_most_likely(checkpoint) -> None:
    """min_p = 1 leaves only the most likely token: sampling at temperature 1 is greedy."""
    loaded, _ = checkpoint

    async def run():
        async with engine(loaded) as eng:
            greedy = await collect(eng, _gen(SamplingParams(max_tokens=10, ignore_eos=True)))
            sampled = await collect(eng, _gen(SamplingParams(
                temperature=1.0, min_p=1.0, seed=3, max_tokens=10, ignore_eos=True)))
            free = await collect(eng, _gen(SamplingParams(
                temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)))
            return tokens(greedy), tokens(sampled), tokens(free)

    greedy, sampled, free = asyncio.run(run())
    assert sampled == greedy and free != greedy


def test_penalized_rows_leave_plain_rows_alone(checkpoint) -> None:
    loaded, _ = checkpoint
    prompts = [PROMPT, PROMPT[3:], PROMPT[:9], PROMPT[::-1]]
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    penal = SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=2.0,
                           frequency_penalty=2.0, repetition_penalty=2.0,
                           logit_bias=((5, 50.0),), logprobs=3)

    async def run():
        async with engine(loaded) as eng:
            alone = [tokens(await collect(eng, _gen(plain, p))) for p in prompts[:2]]
            mixed = await asyncio.gather(*[
                collect(eng, _gen(plain if i < 2 else penal, p)) for i, p in enumerate(prompts)])
            return alone, [tokens(m) for m in mixed]

    alone, mixed = asyncio.run(run())
    assert mixed[:2] == alone
    assert all(5 in m for m in mixed[2:])  # the bias took effect in the penalized rows
    assert not math.isnan(sum(mixed[2]))
