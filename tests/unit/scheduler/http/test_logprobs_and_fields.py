"""Issue 45 at the scheduler: log-probabilities in OpenAI's chat and legacy shapes (whole
and streamed alike, echo first), the sampling controls reaching the engine, and no field
dropped silently (refused with its name, or named in X-Overture-Ignored-Fields and counted;
a 400 under scheduler.strict_fields)."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import pytest

from tests.unit.scheduler.conftest import MiniCluster, call, make_cluster
from tests.unit.scheduler.http.test_http_api import CHAT, post

COMPLETION = {"model": "demo", "prompt": "one two three", "max_tokens": 3}


def _stream_entries(events: list, key: str) -> list:
    out = []
    for e in events[:-1]:
        for c in e["choices"]:
            if c["logprobs"] is not None:
                out.append(c["logprobs"][key])
    return out


async def test_chat_logprobs_whole_and_streamed_agree(cluster: MiniCluster) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 3}
    status, whole = await post(cluster, "/v1/chat/completions", body)
    assert status == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["t0 ", "t1 ", "t2 ", "t3 "]
    assert [c["logprob"] for c in content] == [-0.5, -1.0, -1.5, -2.0]
    assert content[0]["bytes"] == list(b"t0 ")
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["t1 ", "alt1", "alt2"]
    assert cluster.engine.requests[-1].sampling.logprobs == 3
    status, events = await post(cluster, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    streamed = [c for part in _stream_entries(events, "content") for c in part]
    assert streamed == content


async def test_chat_without_logprobs_has_null_and_top_needs_logprobs(
        cluster: MiniCluster) -> None:
    status, whole = await post(cluster, "/v1/chat/completions", CHAT)
    assert status == 200 and whole["choices"][0]["logprobs"] is None
    assert not cluster.engine.requests[-1].sampling.HasField("logprobs")
    status, err = await post(cluster, "/v1/chat/completions", {**CHAT, "top_logprobs": 2})
    assert status == 400 and err["error"]["param"] == "top_logprobs"
    status, err = await post(cluster, "/v1/chat/completions", {**CHAT, "logprobs": True,
                                                                "top_logprobs": 21})
    assert status == 400 and err["error"]["param"] == "top_logprobs"


async def test_completion_legacy_logprobs_with_echo(cluster: MiniCluster) -> None:
    body = {**COMPLETION, "logprobs": 2, "echo": True}
    status, whole = await post(cluster, "/v1/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["text"] == "one two three" + "t0 t1 t2 "
    lp = choice["logprobs"]
    assert lp["tokens"] == ["p3 ", "p3 ", "p5 ", "t0 ", "t1 ", "t2 "]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5, -1.0, -1.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][3] == {"t0 ": -0.5,
                                                                       "alt1": -1.5}
    assert lp["text_offset"] == [0, 3, 6, 9, 12, 15]
    sent = cluster.engine.requests[-1].sampling
    assert (sent.logprobs, sent.prompt_logprobs) == (2, 2)
    status, events = await post(cluster, "/v1/completions", {**body, "stream": True})
    assert status == 200
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == choice["text"]
    parts = _stream_entries(events, "tokens")
    assert [t for p in parts for t in p] == lp["tokens"]
    offsets = [o for e in events[:-1] for c in e["choices"] if c["logprobs"]
               for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


async def test_echo_without_logprobs_and_token_prompts(cluster: MiniCluster) -> None:
    status, whole = await post(cluster, "/v1/completions", {**COMPLETION, "echo": True})
    assert status == 200 and whole["choices"][0]["text"].startswith("one two three")
    assert whole["choices"][0]["logprobs"] is None
    status, whole = await post(cluster, "/v1/completions",
                               {**COMPLETION, "prompt": [9, 8], "echo": True})
    assert status == 200 and whole["choices"][0]["text"] == "p9 p8 t0 t1 t2 "


async def test_sampling_controls_reach_the_engine(cluster: MiniCluster) -> None:
    body = {**CHAT, "presence_penalty": 0.5, "frequency_penalty": -1.0,
            "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"5": 10, "77": -100},
            "top_k": 4, "seed": 3, "stop_token_ids": [9]}
    status, _ = await post(cluster, "/v1/chat/completions", body)
    assert status == 200
    s = cluster.engine.requests[-1].sampling
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.0)
    assert abs(s.min_p - 0.1) < 1e-6
    assert abs(s.repetition_penalty - 1.2) < 1e-6 and dict(s.logit_bias) == {5: 10, 77: -100}
    assert (s.top_k, s.seed, list(s.stop_token_ids)) == (4, 3, [9])
    for bad, param in (({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"5": 101}}, "logit_bias.5"),
                       ({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty")):
        status, err = await post(cluster, "/v1/chat/completions", {**CHAT, **bad})
        assert status == 400 and err["error"]["param"] == param, (bad, err)


async def test_documented_fields_honoured_or_refused_by_name(cluster: MiniCluster) -> None:
    fine = {"user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
            "modalities": ["text"], "safety_identifier": "x"}
    status, _, headers = await call(cluster, "POST", "/v1/chat/completions", {**CHAT, **fine})
    assert status == 200 and "X-Overture-Ignored-Fields" not in headers
    for field, value in (("functions", [{"name": "f"}]), ("audio", {"voice": "x"}),
                         ("modalities", ["text", "audio"]), ("prediction", {"type": "content"}),
                         ("reasoning_effort", "low")):
        status, err = await post(cluster, "/v1/chat/completions", {**CHAT, field: value})
        assert status == 400 and err["error"]["param"] == field, (field, err)
        assert err["error"]["code"] == "unsupported_parameter"
    for field, value in (("best_of", 2), ("suffix", "end")):
        status, err = await post(cluster, "/v1/completions", {**COMPLETION, field: value})
        assert status == 400 and err["error"]["param"] == field
    status, _ = await post(cluster, "/v1/completions", {**COMPLETION, "best_of": 1, "user": "u"})
    assert status == 200


async def _ignored_count(c: MiniCluster) -> float:
    async with c.http.get(c.url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("overture_ignored_fields_total"))


async def test_unknown_fields_named_in_header_and_counted(cluster: MiniCluster) -> None:
    before = await _ignored_count(cluster)
    body = {**CHAT, "frobnicate": 1, "chat_template_kwargs": {"x": 1}}
    status, _, headers = await call(cluster, "POST", "/v1/chat/completions", body)
    assert status == 200
    assert headers["X-Overture-Ignored-Fields"] == "chat_template_kwargs,frobnicate"
    assert await _ignored_count(cluster) == before + 2
    async with cluster.http.post(cluster.url + "/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True})) as r:
        assert r.headers["X-Overture-Ignored-Fields"] == "chat_template_kwargs,frobnicate"


async def test_an_unknown_field_a_header_cannot_carry_is_named_encoded(
        cluster: MiniCluster) -> None:
    # The fuzz test's case: a control character in a field's name dropped the connection.
    body = {**CHAT, "\u001f": None, "a,b": 1, "caf\u00e9": 2}
    status, _, headers = await call(cluster, "POST", "/v1/chat/completions", body)
    assert status == 200
    assert headers["X-Overture-Ignored-Fields"] == "%1F,a%2Cb,caf%C3%A9"


async def test_strict_fields_refuses_unknown_fields() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, strict_fields=True)
        status, err = await post(c, "/v1/chat/completions", {**CHAT, "frobnicate": 1})
        assert status == 400 and err["error"]["param"] == "frobnicate"
        assert err["error"]["code"] == "unknown_field"
        status, _ = await post(c, "/v1/completions", {**COMPLETION, "logprobs": 1})
        assert status == 200


async def test_openai_client_strict_fields() -> None:
    """The official client: an extra field is a 400 naming it under strict_fields."""
    import openai

    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, strict_fields=True)
        client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="demo", messages=CHAT["messages"],
                                                 max_tokens=2, extra_body={"frobnicate": 1})
        assert e.value.body["param"] == "frobnicate"
        r = await client.chat.completions.create(model="demo", messages=CHAT["messages"],
                                                 max_tokens=2, logprobs=True, top_logprobs=2)
        assert [t.token for t in r.choices[0].logprobs.content] == ["t0 ", "t1 "]
        await client.close()


async def test_min_tokens_reaches_the_engine(cluster: MiniCluster) -> None:
    status, _ = await post(cluster, "/v1/completions", {**COMPLETION, "min_tokens": 2})
    assert status == 200 and cluster.engine.requests[-1].sampling.min_tokens == 2
