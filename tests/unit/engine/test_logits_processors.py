"""The logits processors and log-probabilities on synthetic logits (exact numbers), under
a grammar in the engine, and tokens spelled with their bytes."""

from __future__ import annotations

import json

import jsonschema
import torch

from services.engine.api_types import ChatMessage, GenerateRequest, Guidance, SamplingParams
from services.engine.logits_processors import History
from services.engine.model import LoadedModel
from services.engine.sampling import Sampler, make_generator
from services.engine.token_text import TokenText

from .engine_helpers import collect, engine, idle
from .test_constrained import SCHEMA

V = 8


def _run(params: list[SamplingParams], logits: torch.Tensor, hist: list[History],
         masks=None):
    return Sampler().run(logits, params, [make_generator(0)] * len(params), masks, hist)


def test_each_processor_on_hand_numbers() -> None:
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5]])
    hist = [History([3, 1, 6, 6, 2], num_prompt=2)]  # prompt [3, 1], output [6, 6, 2]
    cases = {
        # presence: minus p for 6 and 2 (in the output), not 3 or 1 (prompt only)
        SamplingParams(presence_penalty=1.0, logprobs=V - 1):
            [2.0, -1.0, -0.5, 3.0, -2.0, 0.0, 0.0, -0.5],
        # frequency: minus f * count in the output: 6 twice, 2 once
        SamplingParams(frequency_penalty=0.5, logprobs=V - 1):
            [2.0, -1.0, 0.0, 3.0, -2.0, 0.0, 0.0, -0.5],
        # repetition: prompt and output tokens 3, 1, 6, 2: positive / r, negative * r
        SamplingParams(repetition_penalty=2.0, logprobs=V - 1):
            [2.0, -2.0, 0.25, 1.5, -2.0, 0.0, 0.5, -0.5],
        SamplingParams(logit_bias=((4, 10.0), (0, -100.0)), logprobs=V - 1):
            [-98.0, -1.0, 0.5, 3.0, 8.0, 0.0, 1.0, -0.5],
    }
    for params, want in cases.items():
        got = _run([params], raw, hist)
        expect = torch.tensor(want).log_softmax(-1)
        assert got.tokens == [int(expect.argmax())]
        lp = got.logprobs[0]
        assert lp is not None and abs(lp.logprob - expect.max().item()) < 1e-6
        assert list(lp.top_ids) == expect.topk(V - 1).indices.tolist()
        for v, w in zip(lp.top_logprobs, expect.topk(V - 1).values.tolist(), strict=True):
            assert abs(v - w) < 1e-6


def test_temperature_in_logprobs_and_min_p_truncation() -> None:
    raw = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0, -3.0, -3.0, -3.0]])
    p = SamplingParams(temperature=0.5, seed=0, logprobs=2, min_p=0.2)
    got = _run([p], raw, [History([], 0)])
    expect = (raw[0] / 0.5).log_softmax(-1)
    assert abs(got.logprobs[0].top_logprobs[0] - expect[0].item()) < 1e-6
    # min_p 0.2 at T=0.5: probs e^4 : e^2 : 1 ... keep only p >= 0.2 * max: tokens 0 (and
    # not 1: e^-2 = 0.135 < 0.2)
    draws = {Sampler().run(raw, [p], [make_generator(s)], None, [History([], 0)]).tokens[0]
             for s in range(50)}
    assert draws == {0}


def test_forbidden_tokens_stay_forbidden_and_show_as_floor() -> None:
    raw = torch.zeros(1, V)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[2, 5]] = True
    p = SamplingParams(logit_bias=((0, 100.0),), presence_penalty=-2.0, repetition_penalty=0.5,
                       logprobs=3)
    got = _run([p], raw, [History([0, 1], 1)], [mask])
    assert got.tokens[0] in (2, 5)
    lp = got.logprobs[0]
    assert lp.top_logprobs[-1] == -9999.0  # only two tokens allowed: the third is -inf


def test_plain_rows_untouched_in_a_mixed_batch() -> None:
    raw = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=1.0)
    penal = SamplingParams(temperature=1.0, frequency_penalty=2.0, logit_bias=((3, 50.0),))
    hist = [History(list(range(10)), 5)] * 4
    alone = Sampler().run(raw, [plain] * 4, [make_generator(i) for i in range(4)], None, hist)
    mixed = Sampler().run(raw, [plain, penal, plain, penal],
                          [make_generator(i) for i in range(4)], None, hist)
    assert [mixed.tokens[0], mixed.tokens[2]] == [alone.tokens[0], alone.tokens[2]]
    assert mixed.tokens[1] == mixed.tokens[3] == 3


def test_tokens_spelled_with_their_bytes(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    spell = TokenText(tok)
    ids = tok.encode_prompt("héllo wörld ✓")
    raw = b"".join(spell.spell(t)[1] for t in ids if not tok.is_special(t))
    assert raw.decode() == tok.decode(ids)
    for t in ids:
        text, b = spell.spell(t)
        assert text == b.decode("utf-8", errors="backslashreplace")


async def test_penalties_and_bias_under_a_json_schema(loaded: LoadedModel) -> None:
    """The processors act inside the grammar: the output still follows the schema."""
    async with engine(loaded) as eng:
        for seed in range(3):
            req = GenerateRequest(
                messages=(ChatMessage("user", "json"),),
                sampling=SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                                        presence_penalty=1.5, frequency_penalty=1.0,
                                        repetition_penalty=1.3, min_p=0.05, logprobs=2,
                                        logit_bias=((5, 30.0), (6, -30.0))),
                guidance=Guidance(response_format="json_schema", json_schema=SCHEMA))
            outs = await collect(eng, req)
            assert outs[-1].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(o.text for o in outs)), SCHEMA)
            assert sum(len(o.logprobs) for o in outs) == sum(len(o.token_ids) for o in outs)
        await idle(eng)


async def test_min_tokens_holds_back_eos_and_stop_ids(loaded: LoadedModel) -> None:
    eos = loaded.config.eos_token_ids[0]

    def req(**kw: object) -> GenerateRequest:
        return GenerateRequest(prompt="Hello", sampling=SamplingParams(
            max_tokens=12, logit_bias=((eos, 100.0),), **kw))

    async with engine(loaded) as eng:
        quick = await collect(eng, req())
        held = await collect(eng, req(min_tokens=5))
        stop = await collect(eng, GenerateRequest(prompt="Hello", sampling=SamplingParams(
            max_tokens=12, ignore_eos=True, stop_token_ids=(7,), logit_bias=((7, 100.0),),
            min_tokens=3)))
    assert [t for o in quick for t in o.token_ids] == [eos]
    held_ids = [t for o in held for t in o.token_ids]
    assert len(held_ids) == 6 and held_ids[-1] == eos and eos not in held_ids[:-1]
    stop_ids = [t for o in stop for t in o.token_ids]
    assert len(stop_ids) == 4 and stop_ids[-1] == 7 and 7 not in stop_ids[:-1]
