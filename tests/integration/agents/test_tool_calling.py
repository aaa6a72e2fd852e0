"""Tool calling and structured outputs through the official ``openai`` client, against a real
cluster serving the random-weight demo model: calls and JSON are valid because they are
enforced while sampling, not because the model knows better."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.cluster import Cluster

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def _check_weather_args(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_round_trip_reuses_the_history(client: openai.OpenAI, cluster: Cluster) -> None:
    """call -> tool result -> answer; the second turn reuses the first turn's KV."""
    first = client.chat.completions.create(
        model="demo-tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0.8, seed=1, max_tokens=200, extra_body={"session_id": "tools-1"})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", cluster.logs()
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert {c.function.name for c in calls} <= {"get_weather", "get_time"}
    history = [*ASK, choice.message.model_dump(exclude_none=True)]
    for c in calls:
        json.loads(c.function.arguments)
        history.append({"role": "tool", "tool_call_id": c.id, "content": "18 degrees, sunny"})
    second = client.chat.completions.create(
        model="demo-tiny", messages=history, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0, max_tokens=12, extra_body={"session_id": "tools-1"})
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0, cluster.logs()


def test_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="demo-tiny", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        _check_weather_args(calls[0].function.arguments)


def test_auto_and_none_leave_text_as_content(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model="demo-tiny", messages=ASK, tools=[WEATHER], tool_choice=choice,
            temperature=0, max_tokens=16)
        c = r.choices[0]
        assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
        assert isinstance(c.message.content, str)


def test_streamed_tool_calls_match_the_whole_response(client: openai.OpenAI) -> None:
    kwargs = {"model": "demo-tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                  "temperature": 1.0, "seed": 7, "max_tokens": 200, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    order: list[str] = []
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                    order.append("name")
                if d.function and d.function.arguments:
                    assert d.index in names  # the name comes first
                    args[d.index] = args.get(d.index, "") + d.function.arguments
                    order.append("args")
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and order[0] == "name"
    expected = whole.choices[0].message.tool_calls
    assert [names[i] for i in sorted(names)] == [c.function.name for c in expected]
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in expected]


@pytest.mark.slow
def test_json_schema_output_validates_on_every_seed(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        r = client.chat.completions.create(
            model="demo-tiny", messages=[{"role": "user", "content": "A person, as JSON."}],
            response_format=fmt, temperature=1.0, seed=seed, max_tokens=300)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_parses(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo-tiny", messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, temperature=0.7, seed=3, max_tokens=400)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may write a long object; what there is must be its beginning
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_developer_role_and_bad_tool_requests(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo-tiny", max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."}, *ASK])
    assert r.choices[0].message.role == "assistant"
    bad = [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"tools": [WEATHER, WEATHER]},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo-tiny", messages=ASK, max_tokens=4,
                                           **extra)
        assert e.value.status_code == 400 and e.value.body["message"], extra
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo-tiny", max_tokens=4, messages=[
            *ASK, {"role": "tool", "content": "no id"}])
