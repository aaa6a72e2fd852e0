"""Every bad-input case of the OpenAI endpoints: exact status, error type and param."""

from __future__ import annotations

import json

import pytest

from services.scheduler.api import ApiError, Limits, check_body_size, parse_json, validate

LIMITS = Limits(max_n=4, max_prompts=3, default_max_tokens=0)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def chat(**fields: object) -> dict:
    return {**CHAT, **fields}


def fail(body: dict, endpoint: str = "chat") -> ApiError:
    with pytest.raises(ApiError) as e:
        validate(body, endpoint, LIMITS)  # type: ignore[arg-type]
    return e.value


@pytest.mark.parametrize("raw", [b"{", b"", b"{'a': 1}", b'{"a": NaN}', b"\xff\xfe"])
def test_malformed_json_is_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert (e.value.status, e.value.type, e.value.code) == (
        400,
        "invalid_request_error",
        "invalid_json",
    )


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"text"', b"null"])
def test_body_must_be_an_object(raw: bytes) -> None:
    with pytest.raises(ApiError, match="must be a JSON object") as e:
        parse_json(raw)
    assert e.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        (chat(messages=[]), "messages"),
        (chat(messages="hi"), "messages"),
        (chat(messages={"role": "user"}), "messages"),
        (chat(messages=["hi"]), "messages[0]"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (chat(messages=[{"role": "user"}]), "messages[0].content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
        ),
        (chat(model=""), "model"),
        (chat(model=3), "model"),
        (chat(max_tokens="10"), "max_tokens"),
        (chat(max_tokens=1.5), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=-3), "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(temperature=-0.1), "temperature"),
        (chat(temperature=2.5), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_p=1.01), "top_p"),
        (chat(top_p=[1]), "top_p"),
        (chat(n=0), "n"),
        (chat(n=5), "n"),
        (chat(n="2"), "n"),
        (chat(top_k=-2), "top_k"),
        (chat(stream="yes"), "stream"),
        (chat(stream_options=True, stream=True), "stream_options"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(stop=5), "stop"),
        (chat(stop=[""]), "stop"),
        (chat(seed="7"), "seed"),
        (chat(session_id=12), "session_id"),
        (chat(priority="high"), "priority"),
        (chat(return_token_ids="yes"), "return_token_ids"),
        (chat(logprobs="yes"), "logprobs"),
        (chat(top_logprobs=3), "top_logprobs"),
        (chat(logit_bias={"-1": 2}), "logit_bias"),
        (chat(min_p=1.5), "min_p"),
        (chat(reasoning_effort="high"), "reasoning_effort"),
        (chat(tools=[{"type": "function"}]), "tools[0].function"),
        (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(tool_choice="sometimes"), "tool_choice"),
        (chat(functions=[{"name": "f"}]), "functions"),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (chat(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
         "messages[0].tool_calls"),
        (chat(presence_penalty=-2.5), "presence_penalty"),
        (chat(frequency_penalty="x"), "frequency_penalty"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema"),
        (chat(response_format={"type": "yaml"}), "response_format.type"),
    ],
)
def test_chat_errors(body: dict, param: str) -> None:
    e = fail(body)
    assert e.status == 400
    assert e.type == "invalid_request_error"
    assert e.param == param
    assert e.body()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
    ],
)
def test_completion_errors(body: dict, param: str) -> None:
    e = fail(body, "completion")
    assert (e.status, e.param) == (400, param)


def test_error_body_shape() -> None:
    e = fail(chat(temperature=3))
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert e.body()["error"]["code"] == "out_of_range"
    assert "between 0 and 2" in e.message


def test_body_size_limit_is_413() -> None:
    check_body_size(1024, 1024)
    check_body_size(None, 1024)
    with pytest.raises(ApiError) as e:
        check_body_size(1025, 1024)
    assert e.value.status == 413


def test_valid_chat_request_is_fully_parsed() -> None:
    req = validate(
        chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            n=2,
            temperature=0,
            top_p=0.5,
            top_k=-1,
            max_tokens=7,
            seed=3,
            stop="END",
            stream=True,
            stream_options={"include_usage": True},
            return_token_ids=True,
            session_id="body-session",
            priority=2,
        ),
        "chat",
        LIMITS,
        session_header="header-session",
        tenant="acme",
    )
    assert [m.content for m in req.prompts[0].messages] == ["be brief", "a\nb", ""]
    assert (req.n, req.stream, req.include_usage, req.return_token_ids) == (2, True, True, True)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed, s.stop) == (
        0,
        0.5,
        0,
        7,
        3,
        ("END",),
    )
    assert (req.session_id, req.tenant, req.priority) == ("header-session", "acme", 2)
    assert [(c.index, c.seed) for c in req.choices()] == [(0, 3), (1, 4)]


def test_session_from_body_and_defaults() -> None:
    req = validate(chat(session_id="s1"), "chat", Limits(default_max_tokens=16))
    assert req.session_id == "s1"
    assert req.model == "m"
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.max_tokens) == (1.0, 1.0, 16)
    assert validate({"messages": CHAT["messages"]}, "chat", LIMITS).model is None


def test_prompt_cache_key_names_the_session_when_nothing_else_does() -> None:
    """Issue 41: OpenAI's prompt_cache_key is the session key; session_id and the header
    win over it; prompt_cache_retention takes OpenAI's two values."""
    assert validate(chat(prompt_cache_key="k1"), "chat", LIMITS).session_id == "k1"
    assert validate(chat(prompt_cache_key="k1", session_id="s1"), "chat",
                    LIMITS).session_id == "s1"
    assert validate(chat(prompt_cache_key="k1"), "chat", LIMITS,
                    session_header="h1").session_id == "h1"
    assert validate({"prompt": "x", "prompt_cache_key": "k2"}, "completion",
                    LIMITS).session_id == "k2"
    for retention in ("in_memory", "24h"):
        validate(chat(prompt_cache_retention=retention), "chat", LIMITS)
    with pytest.raises(ApiError) as e:
        validate(chat(prompt_cache_retention="forever"), "chat", LIMITS)
    assert e.value.status == 400 and e.value.param == "prompt_cache_retention"
    with pytest.raises(ApiError):
        validate(chat(prompt_cache_key="a/b"), "chat", LIMITS)  # as session_id: no '/'


def test_completion_prompt_forms_fan_out_prompt_major() -> None:
    req = validate({"prompt": ["a", [5, 6]], "n": 2}, "completion", LIMITS)
    assert [p.kind for p in req.prompts] == ["text", "tokens"]
    assert [(c.index, c.prompt_index) for c in req.choices()] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert validate({"prompt": [1, 2, 3]}, "completion", LIMITS).prompts[0].token_ids == (1, 2, 3)


def test_tools_and_formats_become_guidance() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = validate(chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}},
                        parallel_tool_calls=False), "chat", LIMITS)
    g = req.guidance
    assert json.loads(g.tools_json) == [tool]
    assert g.tool_choice == "function:f" and not g.parallel_tool_calls
    assert validate(chat(), "chat", LIMITS).guidance.tool_choice == "none"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    g = validate(chat(response_format=fmt), "chat", LIMITS).guidance
    assert g.response_format == "json_schema" and json.loads(g.json_schema) == {"type": "integer"}
    text = validate(chat(response_format={"type": "text"}), "chat", LIMITS)
    assert text.guidance.response_format == ""


def test_assistant_tool_calls_and_tool_results_are_kept() -> None:
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "3"}]},
    ]
    (prompt,) = validate(chat(messages=msgs), "chat", LIMITS).prompts
    dev, asst, tool = prompt.messages
    assert dev.role == "system"
    assert asst.content == "" and asst.tool_calls[0].name == "f"
    assert asst.tool_calls[0].arguments == '{"a": 1}' and asst.tool_calls[0].id == "call_1"
    assert tool.tool_call_id == "call_1" and tool.content == "3"


def test_logprobs_penalties_and_ignored_fields_parsed() -> None:
    req = validate(chat(logprobs=True, top_logprobs=4, presence_penalty=1, frequency_penalty=-1,
                        repetition_penalty=1.5, min_p=0.2, logit_bias={"12": -100, "3": 5.5},
                        vendor_x=1, another=None),
                   "chat", LIMITS)
    s = req.sampling
    assert (s.logprobs, s.presence_penalty, s.frequency_penalty) == (4, 1.0, -1.0)
    assert (s.repetition_penalty, s.min_p, s.logit_bias) == (1.5, 0.2, ((3, 5.5), (12, -100.0)))
    assert req.ignored_fields == ("another", "vendor_x")
    assert validate(chat(logprobs=False), "chat", LIMITS).sampling.logprobs == -1
    done = validate({**COMPLETION, "logprobs": 0, "echo": True}, "completion", LIMITS)
    assert (done.sampling.logprobs, done.sampling.echo, done.ignored_fields) == (0, True, ())
    strict = Limits(max_n=4, max_prompts=3, strict_fields=True)
    with pytest.raises(ApiError) as e:
        validate(chat(vendor_x=1), "chat", strict)
    assert (e.value.status, e.value.param, e.value.code) == (400, "vendor_x", "unknown_field")


def test_min_tokens_bounded_by_max_tokens() -> None:
    assert validate(chat(min_tokens=3, max_tokens=3), "chat", LIMITS).sampling.min_tokens == 3
    assert fail(chat(min_tokens=4, max_tokens=3)).param == "min_tokens"
    assert fail(chat(min_tokens=2**31)).param == "min_tokens"
