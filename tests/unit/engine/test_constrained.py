"""Constrained decoding in the engine: masks per sequence, batched with free sequences."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from services.engine.api_types import ChatMessage, GenerateRequest, Guidance, SamplingParams
from services.engine.errors import INVALID_ARGUMENT, EngineError
from services.engine.model import LoadedModel
from services.engine.sampling import Sampler, make_generator

from .engine_helpers import PROMPTS, collect, engine, idle, tokens

SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "y"]},
                         "words": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                   "maxItems": 2}},
          "required": ["n", "tag", "words"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"enum": ["a", "b"]}},
                                     "required": ["q"], "additionalProperties": False}}}


def sampled(prompt: str, seed: int, n: int = 24, **kw: object) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, sampling=SamplingParams(
        temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True), **kw)


def constrained(seed: int) -> GenerateRequest:
    return GenerateRequest(
        messages=(ChatMessage("user", "json"),),
        sampling=SamplingParams(temperature=1.0, seed=seed, max_tokens=300),
        guidance=Guidance(response_format="json_schema", json_schema=SCHEMA))


def test_sampler_touches_only_masked_rows() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(50, dtype=torch.bool)
    mask[[7, 9]] = True
    params = [SamplingParams(temperature=1.0)] * 3
    free = Sampler().sample(logits, params, [make_generator(i) for i in range(3)])
    masked = Sampler().sample(logits, params, [make_generator(i) for i in range(3)],
                              [None, mask, None])
    assert masked[0] == free[0] and masked[2] == free[2] and masked[1] in (7, 9)
    greedy = Sampler().sample(logits, [SamplingParams()] * 3, [make_generator(0)] * 3,
                              [mask, None, None])
    assert greedy[0] == (7 if logits[0, 7] > logits[0, 9] else 9)


async def test_free_sequences_sample_the_same_beside_constrained_ones(
        loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        alone = [tokens(await collect(eng, sampled(p, seed=i))) for i, p in enumerate(PROMPTS[:4])]
        free = [collect(eng, sampled(p, seed=i)) for i, p in enumerate(PROMPTS[:4])]
        guided = [collect(eng, constrained(seed)) for seed in range(4)]
        results = await asyncio.gather(*free, *guided)
        assert [tokens(r) for r in results[:4]] == alone
        for outs in results[4:]:
            assert outs[-1].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(o.text for o in outs)), SCHEMA)
        await idle(eng)


async def test_forced_tool_call_is_parsed(loaded: LoadedModel) -> None:
    async with engine(loaded) as eng:
        req = GenerateRequest(
            messages=(ChatMessage("user", "look it up"),),
            sampling=SamplingParams(temperature=1.0, seed=5, max_tokens=200),
            guidance=Guidance(tools=(TOOL,), tool_choice="function:lookup"))
        outs = await collect(eng, req)
        calls = [c for o in outs for c in o.tool_calls]
        assert outs[-1].finish_reason == "tool_calls"
        assert len(calls) == 1 and calls[0].name == "lookup"
        assert json.loads(calls[0].arguments)["q"] in ("a", "b")
        assert "".join(o.text for o in outs) == ""


@pytest.mark.parametrize("guidance", [
    Guidance(response_format="json_schema", json_schema={"type": "nonsense"}),
    Guidance(tools=(TOOL,), tool_choice="function:other"),
])
async def test_bad_grammar_is_a_bad_request(loaded: LoadedModel, guidance: Guidance) -> None:
    async with engine(loaded) as eng:
        req = GenerateRequest(messages=(ChatMessage("user", "x"),), guidance=guidance)
        with pytest.raises(EngineError) as e:
            await collect(eng, req)
        assert e.value.code == INVALID_ARGUMENT
