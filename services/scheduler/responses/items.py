"""Responses API items <-> chat messages, and the Response object itself.

    input items                              chat messages
    {"role": "user", "content": ...}     ->  user (developer -> system)
    {"type": "function_call", ...}       ->  the calls of one assistant message (merged
                                             with the assistant text just before them)
    {"type": "function_call_output"}     ->  tool (tool_call_id = call_id)
    {"type": "reasoning"}                ->  (dropped: no model here reasons in items)
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from services.scheduler.api import ChoiceState, Message, ToolCall, invalid, kv_source


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or p.get("refusal") or "" for p in content)


def to_messages(items: str | list[dict[str, Any]]) -> list[Message]:
    if isinstance(items, str):
        return [Message("user", items)]
    out: list[Message] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "reasoning":
            continue
        if kind == "message":
            if "role" not in item or "content" not in item:
                raise invalid(f"'{where}' is a message: it needs 'role' and 'content'", where,
                              "missing_required_parameter")
            role = "system" if item["role"] == "developer" else item["role"]
            out.append(Message(role, _text(item["content"])))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if key not in item:
                    raise invalid(f"'{where}.{key}' is required for a function_call",
                                  f"{where}.{key}", "missing_required_parameter")
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = Message("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        else:  # function_call_output
            if "call_id" not in item or "output" not in item:
                raise invalid(f"'{where}' needs 'call_id' and 'output'", where,
                              "missing_required_parameter")
            out.append(Message("tool", _text(item["output"]), tool_call_id=item["call_id"]))
    if not out:
        raise invalid("'input' holds no message or function output", "input", "empty_array")
    return out


def chat_guidance_fields(v: dict[str, Any]) -> dict[str, Any]:
    """The body's tools, tool_choice and text.format in chat-completions form."""
    out: dict[str, Any] = {}
    tools = v.get("tools") or []
    if tools:
        out["tools"] = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
            for t in tools]
    choice = v.get("tool_choice")
    if isinstance(choice, dict):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    out["parallel_tool_calls"] = v.get("parallel_tool_calls", True)
    fmt = (v.get("text") or {}).get("format")
    if fmt and fmt["type"] == "json_schema":
        if "schema" not in fmt:
            raise invalid("'text.format.schema' is required for type json_schema",
                          "text.format.schema", "missing_required_parameter")
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    elif fmt:
        out["response_format"] = {"type": fmt["type"]}
    return out


def output_items(st: ChoiceState, message_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    text = "".join(st.text)
    if text or not st.tool_calls:
        items.append(message_item(message_id, text, "completed"))
    items.extend(call_item(c.id, c.name, c.arguments, "completed") for c in st.tool_calls)
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id.removeprefix('call_')}", "type": "function_call",
            "status": status, "call_id": call_id, "name": name, "arguments": arguments}


def assistant_message(st: ChoiceState) -> Message:
    """This response's output as the history of the next one."""
    return Message("assistant", "".join(st.text),
                   tuple(ToolCall(c.id, c.name, c.arguments) for c in st.tool_calls))


def usage(st: ChoiceState) -> dict[str, Any]:
    return {"input_tokens": st.prompt_tokens,
            "input_tokens_details": {"cached_tokens": st.cached_tokens, **kv_source([st])},
            "output_tokens": st.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": st.prompt_tokens + st.completion_tokens}


def response_object(rid: str, model: str, v: dict[str, Any], session_id: str, *,
                    status: str, output: list[dict[str, Any]],
                    st: ChoiceState | None = None, created: int | None = None
                    ) -> dict[str, Any]:
    incomplete = None
    if st is not None and st.finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": rid,
        "object": "response",
        "created_at": created or int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage(st) if st is not None and status != "in_progress" else None,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": v.get("instructions"),
        "previous_response_id": v.get("previous_response_id"),
        "tools": v.get("tools", []),
        "tool_choice": v.get("tool_choice", "auto"),
        "parallel_tool_calls": v.get("parallel_tool_calls", True),
        "temperature": v.get("temperature", 1.0),
        "top_p": v.get("top_p", 1.0),
        "max_output_tokens": v.get("max_output_tokens"),
        "text": v.get("text") or {"format": {"type": "text"}},
        "metadata": v.get("metadata") or {},
        "store": v.get("store", True),
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "user": None,
        "session_id": session_id,  # (Overture: advise the chain's next turn with it)
    }
