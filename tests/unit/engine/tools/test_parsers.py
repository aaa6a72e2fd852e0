"""Each family's tool-call parser against hand-written outputs, well-formed and not."""

from __future__ import annotations

import json

import pytest

from services.engine.api_types import ToolCall
from services.engine.tools import FORMATS, ToolCallStream, detect

NAMES = ["get_weather", "get_time"]


def parse(family: str, text: str, pieces: int = 1) -> tuple[str, list[ToolCall]]:
    """Feed ``text`` in ``pieces`` roughly equal parts, as a stream would."""
    s = ToolCallStream(FORMATS[family], NAMES)
    step = max(1, len(text) // pieces)
    content, calls = [], []
    for i in range(0, len(text), step):
        c, k = s.feed(text[i:i + step])
        content.append(c)
        calls += k
    c, k = s.finish()
    return "".join(content) + c, calls + k


def args(call: ToolCall) -> dict:
    return json.loads(call.arguments)


@pytest.mark.parametrize("pieces", [1, 3, 50])
def test_hermes_calls_and_content(pieces: int) -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n'
            '</tool_call>')
    content, calls = parse("hermes", text, pieces)
    assert content == "Let me look."  # (whitespace before a call is not content)
    assert [c.name for c in calls] == NAMES and [c.index for c in calls] == [0, 1]
    assert args(calls[0]) == {"city": "Oslo"} and args(calls[1]) == {"zone": 2}
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"a": 1',  # cut off
    "a < b and <tool_ca",  # looks like a marker start, is not one
])
def test_hermes_malformed_stays_content(text: str) -> None:
    for pieces in (1, 7):
        content, calls = parse("hermes", text, pieces)
        assert calls == [] and content.strip() == text.strip()


def test_hermes_call_left_open_at_the_end_is_still_a_call() -> None:
    _, calls = parse("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}', 3)
    assert args(calls[0]) == {"zone": 1}


def test_hermes_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": 1}"}</tool_call>'
    _, calls = parse("hermes", text)
    assert args(calls[0]) == {"zone": 1}


@pytest.mark.parametrize("pieces", [1, 4, 60])
def test_llama3_json(pieces: int) -> None:
    content, calls = parse("llama3_json", ' {"name": "get_weather", "parameters": '
                           '{"city": "Rome"}}', pieces)
    assert content == "" and calls[0].name == "get_weather" and args(calls[0]) == {"city": "Rome"}
    _, two = parse("llama3_json", '{"name": "get_time", "parameters": {"zone": 1}}; '
                   '{"name": "get_weather", "parameters": {"city": "X"}}', pieces)
    assert [c.name for c in two] == ["get_time", "get_weather"]
    content, calls = parse("llama3_json", '<|python_tag|>{"name": "get_time", '
                           '"arguments": {"zone": 3}}', pieces)
    assert calls[0].name == "get_time" and content == ""


@pytest.mark.parametrize("text", [
    "The answer is 4.",
    '{"name": "get_weather"',  # cut off
    '{"city": "Rome"}',  # JSON, but not a call
    '{"name": "unknown", "parameters": {}}',
])
def test_llama3_text_that_is_not_a_call(text: str) -> None:
    content, calls = parse("llama3_json", text, 3)
    assert calls == [] and content == text


@pytest.mark.parametrize("pieces", [1, 5])
def test_mistral(pieces: int) -> None:
    text = ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
            '{"name": "get_time", "arguments": {"zone": 0}}]')
    content, calls = parse("mistral", text, pieces)
    assert content == "Sure." and [c.name for c in calls] == NAMES
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # (its templates check)
    # [TOOL_CALLS] is a special token the detokenizer drops: a leading array is calls too
    _, calls = parse("mistral", '[{"name": "get_time", "arguments": {"zone": 5}}]', pieces)
    assert args(calls[0]) == {"zone": 5}
    content, calls = parse("mistral", '[TOOL_CALLS][{"name": "get_time", "argu', pieces)
    assert calls == [] and content == '[TOOL_CALLS][{"name": "get_time", "argu'
    content, calls = parse("mistral", "[1, 2] is a list", pieces)
    assert calls == [] and content == "[1, 2] is a list"


def test_family_from_the_chat_template() -> None:
    assert detect("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect("{{ '<|python_tag|>' }} ipython").name == "llama3_json"
    assert detect("[AVAILABLE_TOOLS] [TOOL_CALLS]").name == "mistral"
    assert detect("{{ messages }}").name == "hermes"  # no convention: ours
    assert detect("<tool_call>", override="mistral").name == "mistral"


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_written_calls_parse_back(family: str) -> None:
    """What the history renders for an assistant's calls is what the parser reads."""
    fmt = FORMATS[family]
    calls = (ToolCall("call_a", "get_weather", '{"city": "Bergen"}'),
             ToolCall("call_b", "get_time", '{"zone": 9}'))
    content, parsed = parse(family, fmt.call_text(calls), 4)
    assert content == ""
    assert [(c.name, args(c)) for c in parsed] == [("get_weather", {"city": "Bergen"}),
                                                   ("get_time", {"zone": 9})]


def test_forced_call_arguments_take_only_declared_parameters() -> None:
    from services.engine.tools.formats import closed

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
        "c": {"type": "object", "properties": {}, "additionalProperties": True}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["anyOf"][0]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # (the caller's schema is left alone)


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    text = ('<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}</tool_call>')
    s = ToolCallStream(FORMATS["hermes"], NAMES, parallel=False)
    content, calls = s.feed(text)
    tail, more = s.finish()
    assert [c.name for c in calls + more] == ["get_time"] and content + tail == ""
