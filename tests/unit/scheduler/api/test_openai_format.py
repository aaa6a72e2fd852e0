"""SSE framing and OpenAI object shapes."""

from __future__ import annotations

import json

from services.scheduler.api import Chunk
from services.scheduler.api.openai_format import (
    SSE_DONE,
    ChoiceState,
    Envelope,
    full_response,
    sse,
    stream_chunk,
    usage,
    usage_chunk,
)


def test_sse_frame() -> None:
    frame = sse({"a": [1, "é"]})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert b"\n" not in frame[:-2]
    assert json.loads(frame[6:]) == {"a": [1, "é"]}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chat_stream_chunks() -> None:
    env = Envelope("chat", "chatcmpl-1", "m", created=5)
    head = stream_chunk(env, 0, role=True, prompt_token_ids=(1, 2))
    assert head["object"] == "chat.completion.chunk"
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert head["choices"][0]["prompt_token_ids"] == [1, 2]
    assert "usage" not in head
    body = stream_chunk(env, 1, text="hi", token_ids=(7,), include_usage=True, finish_reason="stop")
    assert body["choices"] == [
        {
            "index": 1,
            "delta": {"content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
            "token_ids": [7],
        }
    ]
    assert body["usage"] is None


def test_completion_chunk_and_usage_chunk() -> None:
    env = Envelope("completion", "cmpl-1", "m", created=5)
    c = stream_chunk(env, 0, text="x")
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "x"
    s = ChoiceState(0, 0)
    s.add(Chunk(prompt_token_ids=(1, 2, 3), prompt_tokens=3))
    s.add(Chunk(text="a", token_ids=(9,), completion_tokens=1, finish_reason="length"))
    u = usage_chunk(env, [s])
    assert u["choices"] == []
    assert u["usage"]["prompt_tokens"] == 3 and u["usage"]["total_tokens"] == 4


def test_usage_counts_each_prompt_once() -> None:
    states = []
    for index, prompt_index, completion in [(0, 0, 2), (1, 0, 3), (2, 1, 1)]:
        s = ChoiceState(index, prompt_index)
        s.add(Chunk(prompt_tokens=4 + prompt_index, completion_tokens=completion))
        states.append(s)
    u = usage(states)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (9, 6, 15)


def test_full_response_with_token_ids() -> None:
    env = Envelope("chat", "chatcmpl-1", "m", created=5)
    s = ChoiceState(0, 0)
    s.add(Chunk(prompt_token_ids=(1, 2), prompt_tokens=2))
    s.add(Chunk(text="he", token_ids=(3,), completion_tokens=1))
    s.add(Chunk(text="y", token_ids=(4,), completion_tokens=2, finish_reason="stop"))
    r = full_response(env, [s], return_token_ids=True)
    assert r["object"] == "chat.completion"
    choice = r["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hey"}
    assert (choice["token_ids"], choice["prompt_token_ids"]) == ([3, 4], [1, 2])
    assert r["usage"]["completion_tokens"] == 2
    assert "token_ids" not in full_response(env, [s], return_token_ids=False)["choices"][0]
