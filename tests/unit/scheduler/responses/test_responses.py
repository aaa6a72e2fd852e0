"""The Responses API's pieces: input items as chat messages, the output as items, the store."""

from __future__ import annotations

import pytest

from services.scheduler.api import (
    ApiError,
    ChoiceState,
    Chunk,
    Limits,
    Message,
    ToolCall,
    ToolCallOut,
    guidance,
    responses_body,
)
from services.scheduler.responses import ResponseStore
from services.scheduler.responses.items import chat_guidance_fields, output_items, to_messages


def test_items_become_the_chat_a_template_renders() -> None:
    msgs = to_messages([
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Let me see.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": "two"},
    ])
    assert msgs == [
        Message("system", "be brief"),
        Message("user", "hi"),
        Message("assistant", "Let me see.", (ToolCall("call_1", "f", "{}"),
                                             ToolCall("call_2", "g", '{"x": 1}'))),
        Message("tool", "one", tool_call_id="call_1"),
        Message("tool", "two", tool_call_id="call_2"),
    ]
    assert to_messages("hello") == [Message("user", "hello")]


@pytest.mark.parametrize("item", [
    {"type": "function_call", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "output": "x"},
    {"type": "message", "role": "user"},
])
def test_incomplete_items_are_refused(item: dict) -> None:
    with pytest.raises(ApiError) as e:
        to_messages([item])
    assert e.value.status == 400


def test_body_checks_and_tools_in_chat_form() -> None:
    body = responses_body(Limits()).check({
        "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}}})
    g = guidance(chat_guidance_fields(body))
    assert g.tool_choice == "function:f" and g.has_tools
    assert g.response_format == "json_schema"
    for bad in ({"input": []}, {"input": "x", "tools": [{"type": "web_search"}]},
                {"input": "x", "tool_choice": {"type": "function", "name": "nope"}},
                {"input": "x", "text": {"format": {"type": "json_schema"}}}):
        with pytest.raises(ApiError):
            guidance(chat_guidance_fields(responses_body(Limits()).check(bad)))


def test_output_items_from_a_generation() -> None:
    st = ChoiceState(0, 0)
    st.add(Chunk(text="Checking.", token_ids=(1,), prompt_tokens=5))
    st.add(Chunk(tool_calls=(ToolCallOut(0, "call_ab", "f", '{"a": 1}'),), token_ids=(2,),
                 finish_reason="tool_calls"))
    out = output_items(st, "msg_1")
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Checking."
    assert out[1]["call_id"] == "call_ab" and out[1]["arguments"] == '{"a": 1}'
    empty = ChoiceState(0, 0)
    assert [o["type"] for o in output_items(empty, "msg_2")] == ["message"]


async def test_store_is_per_tenant_expires_and_keeps_the_most_recently_used() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10.0, max_items=2, clock=lambda: now[0])
    await store.put("a", {"id": "r1"}, (), "s1")
    await store.put("a", {"id": "r2"}, (), "s1")
    assert await store.get("b", "r1") is None  # another tenant's
    assert await store.get("a", "r1") is not None  # (r1 now the most recently used)
    await store.put("a", {"id": "r3"}, (), "s1")
    assert await store.get("a", "r2") is None and await store.get("a", "r1") is not None
    now[0] = 11.0
    assert await store.get("a", "r1") is None and await store.get("a", "r3") is None
    await store.put("a", {"id": "r4"}, (), "s2")
    assert await store.delete("a", "r4") and not await store.delete("a", "r4")
