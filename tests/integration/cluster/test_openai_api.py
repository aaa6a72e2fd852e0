"""The official ``openai`` client against a real cluster (scheduler, kvstore, engine and node
manager processes on loopback)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.cluster import Cluster, start_cluster

MESSAGES = [{"role": "user", "content": "Tell me about the overture of an opera."}]


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("cluster"), tiny_model) as c:
        yield c


@pytest.fixture(scope="module")
def model(cluster: Cluster) -> str:
    status, body = cluster.get("/v1/models")
    assert status == 200 and len(body["data"]) == 1, (body, cluster.logs())
    return body["data"][0]["id"]


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_chat_completion(client: openai.OpenAI, model: str, cluster: Cluster) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == model
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8, cluster.logs()
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


def test_streamed_chat_matches_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    text, tokens, usage, finish = [], 0, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            tokens += len(getattr(c, "token_ids", None) or [])
            finish = c.finish_reason or finish
    assert usage is not None and finish in ("stop", "length")
    assert usage.completion_tokens == tokens
    full = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert "".join(text) == full.choices[0].message.content
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_legacy_completions(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert 1 <= r.usage.completion_tokens <= 6
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == r.choices[0].text
    r2 = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, n=2)
    assert sorted(c.index for c in r2.choices) == [0, 1]


async def test_sixteen_concurrent_streams(cluster: Cluster, model: str) -> None:
    # (retrying a 429 as the client does by default: on a loaded machine the engine's
    # forecast may price the burst's prompts past its queue limit and refuse a few)
    client = openai.AsyncOpenAI(
        base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=4
    )
    prompt = [{"role": "user", "content": "Count the stars, one by one."}]
    reference = await client.chat.completions.create(model=model, messages=prompt, max_tokens=1)

    async def one(i: int) -> tuple[int, int, int]:
        stream = await client.chat.completions.create(
            model=model,
            messages=prompt,
            max_tokens=8 + i % 5,
            stream=True,
            seed=i,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "session_id": f"s{i}"},
        )
        tokens, usage = 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                tokens += len(getattr(c, "token_ids", None) or [])
        assert usage is not None
        return tokens, usage.completion_tokens, usage.prompt_tokens

    results = await asyncio.gather(*(one(i) for i in range(16)))
    await client.close()
    for i, (tokens, completion_tokens, prompt_tokens) in enumerate(results):
        assert completion_tokens == tokens, (i, results, cluster.logs())
        assert 1 <= tokens <= 8 + i % 5
        assert prompt_tokens == reference.usage.prompt_tokens


def test_bad_inputs_through_the_stack(client: openai.OpenAI, model: str, cluster: Cluster) -> None:
    status, body = cluster.get("/v1/models")
    context = body["data"][0]["max_model_len"]
    assert context > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hello " * (context + 10), max_tokens=4)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=3)
    status, answer = cluster.post("/v1/chat/completions", b"{oops")
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"


def test_disconnect_frees_the_engine_slot(cluster: Cluster, model: str) -> None:
    _status, body = cluster.get("/v1/models")
    body = {
        "model": model,
        "prompt": "The longest story ever told:",
        "stream": True,
        "max_tokens": body["data"][0]["max_model_len"] - 32,
        "ignore_eos": True,
    }
    host, port = cluster.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        assert r.status == 200
        first = r.readline()
        assert first.startswith(b"data: ")
        assert json.loads(first[6:])["object"] == "text_completion"
        assert cluster.engine_status().running >= 1
    finally:
        conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while cluster.engine_status().running != 0:
        assert time.monotonic() < deadline, f"engine slot not freed\n{cluster.logs()}"
        time.sleep(0.1)
    metrics = cluster.text("/metrics")
    assert 'overture_requests_total{route="/v1/completions",status="499"}' in metrics


def test_health_endpoints_and_metrics(cluster: Cluster) -> None:
    assert cluster.get("/healthz")[0] == 200
    status, ready = cluster.get("/readyz")
    assert status == 200 and ready["healthy_nodes"] == ["node0"]
    text = cluster.text("/metrics")
    assert "overture_time_to_first_token_seconds_count" in text
    assert "overture_healthy_nodes 1.0" in text


def test_logprobs_and_sampling_controls_with_the_openai_client(client: openai.OpenAI,
                                                               model: str) -> None:
    """Issue 45: every new field through the official client; streamed equals whole."""
    kw: dict[str, Any] = {
        "model": model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
        "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.4,
        "frequency_penalty": 0.3, "logit_bias": {"40": 2.0}, "seed": 1,
        "extra_body": {"repetition_penalty": 1.1, "min_p": 0.05, "top_k": 5}}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token in [t.token for t in entry.top_logprobs]  # greedy: the top one
        assert entry.bytes is not None
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed.extend(c.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    done = client.completions.create(model=model, prompt="The overture of an opera",
                                     max_tokens=1, temperature=0, logprobs=2, echo=True,
                                     presence_penalty=0.1, frequency_penalty=0.1,
                                     logit_bias={"7": -1.0}, user="u1")
    lp = done.choices[0].logprobs
    assert done.choices[0].text.startswith("The overture of an opera")
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == done.usage.prompt_tokens + done.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset)


def test_unknown_and_refused_fields_with_the_openai_client(client: openai.OpenAI,
                                                           model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=2, user="u", metadata={"k": "v"},
        extra_body={"frobnicate": True})
    assert raw.headers["X-Overture-Ignored-Fields"] == "frobnicate"
    assert raw.parse().choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       reasoning_effort="high")
    assert e.value.body["param"] == "reasoning_effort"
