"""Issue 43, finding 5: tools, schemas and messages count against one budget checked
before the engine tokenizes anything or compiles a grammar, so a 4 MB tool schema costs
microseconds, not seconds of tokenizing and gigabytes of memory."""

from __future__ import annotations

import pytest

from services.engine import validation
from services.engine.api_types import ChatMessage, GenerateRequest, Guidance, SamplingParams
from services.engine.errors import EngineError
from services.engine.input_size import check_input_size, estimate_tokens, input_parts
from services.engine.model import LoadedModel
from tests.unit.engine.engine_helpers import engine, idle

HI = (ChatMessage("user", "hi"),)


def huge_tool(nbytes: int) -> dict:
    """A function tool whose parameter schema is about ``nbytes`` of JSON."""
    props = {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(nbytes // 240)}
    return {"type": "function",
            "function": {"name": "big", "parameters": {"type": "object", "properties": props}}}


def test_every_part_of_the_input_counts() -> None:
    req = GenerateRequest(
        messages=(ChatMessage("user", "a" * 100, name="bob"),),
        guidance=Guidance(tools=(huge_tool(4000),), response_format="json_schema",
                          json_schema={"type": "object"}))
    ids, chars = input_parts(req)
    assert ids == 0 and chars > 100 + 3 + 4000
    assert estimate_tokens((ids, chars)) == int(chars / 4)
    assert estimate_tokens(input_parts(GenerateRequest(prompt_token_ids=(1, 2, 3)))) == 3
    with pytest.raises(EngineError, match="needs at least") as e:
        check_input_size(req, max_model_len=100)  # 100 tokens hold 3,200 characters at most
    assert e.value.code == "invalid_argument"
    check_input_size(req, max_model_len=1000)


async def test_a_4mb_tool_schema_is_refused_before_tokenizing(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[GenerateRequest] = []
    real = validation.tokenize

    def counting(req, tokenizer, guidance=None):  # type: ignore[no-untyped-def]
        calls.append(req)
        return real(req, tokenizer, guidance)

    monkeypatch.setattr(validation, "tokenize", counting)
    async with engine(loaded, max_model_len=256) as eng:
        big = GenerateRequest(messages=HI, sampling=SamplingParams(max_tokens=2),
                              guidance=Guidance(tools=(huge_tool(4_000_000),)))
        with pytest.raises(EngineError, match="needs at least") as e:
            await eng.generate(big).__anext__()
        assert e.value.code == "invalid_argument"
        assert calls == []  # refused by the budget: the tokenizer never saw it
        # (prepare, the engine's one validation entry point, refuses it the same way)
        with pytest.raises(EngineError, match="needs at least"):
            validation.prepare(big, tokenizer=loaded.tokenizer, model_name=loaded.name,
                               vocab_size=loaded.config.vocab_size, max_model_len=256,
                               fingerprint="f")
        assert calls == []
        small = GenerateRequest(messages=HI, sampling=SamplingParams(max_tokens=2))
        outs = [o async for o in eng.generate(small)]
        assert outs[-1].finish_reason is not None and len(calls) == 1
        await idle(eng)


async def test_memory_grown_for_a_large_input_is_handed_back(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(validation, "trim_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(validation, "LARGE_INPUT_CHARS", 2000)
    async with engine(loaded, max_model_len=256) as eng:
        small = GenerateRequest(messages=HI, sampling=SamplingParams(max_tokens=2))
        [o async for o in eng.generate(small)]
        assert trims == []
        large = GenerateRequest(messages=(ChatMessage("user", "ab " * 1000),),
                                sampling=SamplingParams(max_tokens=2))
        with pytest.raises(EngineError):  # (within the budget, but over the context)
            [o async for o in eng.generate(large)]
        assert trims == [1]  # the tokenizer's scratch went back, failed or not
        await idle(eng)
