"""Turn an OpenAI request body into an ``ApiRequest`` or raise a 4xx ``ApiError``.

The body was decoded by ``json_body.py``; types and ranges are checked by the bodies'
schemas (``bodies.py``, which ``/openapi.json`` publishes); what a schema cannot say is
checked here. Every check names the offending ``param`` as OpenAI does, so clients can
point at the field. No field is dropped silently: a documented field this server cannot
honour is refused (``_unsupported``); one nobody documents is ignored, as vLLM does, but
named (``ignored_fields``: a response header and a metric; a 400 under
``scheduler.strict_fields``).
"""

from __future__ import annotations

import json
from typing import Any

from services.scheduler.api.bodies import REFUSED, body_schema, session_field
from services.scheduler.api.errors import invalid
from services.scheduler.api.limits import Limits
from services.scheduler.api.request import (
    ApiRequest,
    Endpoint,
    Guidance,
    Message,
    Prompt,
    Sampling,
    ToolCall,
)
from services.scheduler.api.schema import is_int


def _unsupported(body: dict[str, Any], endpoint: Endpoint) -> None:
    """OpenAI fields this server cannot honour, when set: a 400 naming them (bodies.py)."""
    # (text alone is what every model here answers in)
    checks = [(key, body.get(key) not in (None, ["text"] if key == "modalities" else None))
              for key in REFUSED[endpoint]]
    if endpoint == "completion":
        checks.append(("best_of", is_int(body.get("best_of")) and body["best_of"] > 1))
        checks.append(("suffix", bool(body.get("suffix"))))
    for key, bad in checks:
        if bad:
            raise invalid(f"'{key}' is not supported by this server", key, "unsupported_parameter")


def ignored_fields(body: dict[str, Any], endpoint: Endpoint, limits: Limits) -> tuple[str, ...]:
    """Fields nobody documents for ``endpoint``: ignored (as vLLM does) but named, or a 400
    under ``scheduler.strict_fields``."""
    known = body_schema(endpoint, limits).fields.keys() | set(REFUSED[endpoint])
    unknown = tuple(sorted(k for k in body if k not in known))
    if unknown and limits.strict_fields:
        raise invalid(f"unknown field '{unknown[0]}' (scheduler.strict_fields is on)",
                      unknown[0], "unknown_field")
    return unknown


def _messages(msgs: list[dict[str, Any]]) -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(msgs):
        role, content = m["role"], m.get("content")
        calls = m.get("tool_calls") or []
        if content is None and not (role == "assistant"):
            raise invalid(f"'messages[{i}].content' is required", f"messages[{i}].content",
                          "missing_required_parameter")
        if calls and role != "assistant":
            raise invalid(f"'messages[{i}].tool_calls' is only for assistant messages",
                          f"messages[{i}].tool_calls", "invalid_value")
        if role == "tool" and not m.get("tool_call_id"):
            raise invalid(f"'messages[{i}].tool_call_id' is required for a tool message",
                          f"messages[{i}].tool_call_id", "missing_required_parameter")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        # OpenAI's "developer" is the system message of the templates models ship with.
        out.append(Message(
            "system" if role == "developer" else role, content or "",
            tool_calls=tuple(ToolCall(c.get("id", ""), c["function"]["name"],
                                      c["function"]["arguments"]) for c in calls),
            tool_call_id=m.get("tool_call_id", "") if role == "tool" else "",
            name=m.get("name", "")))
    return tuple(out)


def guidance(v: dict[str, Any]) -> Guidance:
    """Tools, tool_choice and response_format of a checked body (chat or Responses)."""
    tools = v.get("tools") or []
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("'tools' names a function twice", "tools", "invalid_value")
    choice = v.get("tool_choice", "auto")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise invalid(f"'tool_choice' names {name!r}, which is not among 'tools'",
                          "tool_choice", "invalid_value")
        choice = f"function:{name}"
    elif choice == "required" and not tools:
        raise invalid("'tool_choice' is 'required' but no 'tools' are given", "tool_choice",
                      "invalid_value")
    fmt = v.get("response_format") or {"type": "text"}
    kind = "" if fmt["type"] == "text" else fmt["type"]
    schema = ""
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None or spec.get("schema") is None:
            raise invalid("'response_format.json_schema.schema' is required for type "
                          "json_schema", "response_format.json_schema.schema",
                          "missing_required_parameter")
        schema = json.dumps(spec["schema"])
    return Guidance(
        tools_json=json.dumps(tools) if tools else "",
        tool_choice=choice if tools else "none",
        parallel_tool_calls=v.get("parallel_tool_calls", True),
        response_format=kind,
        json_schema=schema,
    )


def _prompts(p: str | list[Any]) -> tuple[Prompt, ...]:
    if isinstance(p, str):
        return (Prompt("text", text=p),)
    if all(is_int(t) for t in p):
        return (Prompt("tokens", token_ids=tuple(p)),)
    return tuple(Prompt("text", text=item) if isinstance(item, str)
                 else Prompt("tokens", token_ids=tuple(item)) for item in p)


def _sampling(v: dict[str, Any], limits: Limits) -> Sampling:
    max_tokens = v.get("max_completion_tokens", v.get("max_tokens"))
    if max_tokens is not None and v.get("min_tokens", 0) > max_tokens:
        raise invalid("'min_tokens' must not exceed 'max_tokens'", "min_tokens", "out_of_range")
    stop = v.get("stop", ())
    return Sampling(
        temperature=v.get("temperature", 1.0),
        top_p=v.get("top_p", 1.0),
        top_k=max(v.get("top_k", 0), 0),  # -1 (vLLM's "off") and 0 both mean off
        max_tokens=max_tokens if max_tokens is not None else limits.default_max_tokens,
        seed=v.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(v.get("stop_token_ids", ())),
        ignore_eos=v.get("ignore_eos", False),
        presence_penalty=v.get("presence_penalty", 0.0),
        frequency_penalty=v.get("frequency_penalty", 0.0),
        repetition_penalty=v.get("repetition_penalty", 1.0),
        min_p=v.get("min_p", 0.0),
        min_tokens=v.get("min_tokens", 0),
        logit_bias=v.get("logit_bias", ()),
        logprobs=_logprobs(v),
        echo=v.get("echo", False),
    )


def _logprobs(v: dict[str, Any]) -> int:
    """-1: none; else how many alternatives (chat: logprobs true + top_logprobs)."""
    lp = v.get("logprobs")
    if "top_logprobs" in v and lp is not True:  # (only chat has it)
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if isinstance(lp, bool):  # chat
        return v.get("top_logprobs", 0) if lp else -1
    return -1 if lp is None else lp


def validate(
    body: dict[str, Any],
    endpoint: Endpoint,
    limits: Limits,
    *,
    session_header: str = "",
    tenant: str = "default",
) -> ApiRequest:
    """Check every field of a chat or completion body; raise a 4xx ``ApiError`` on the first
    problem."""
    _unsupported(body, endpoint)
    v = body_schema(endpoint, limits).check(body)
    ignored = ignored_fields(body, endpoint, limits)
    prompts = (
        (Prompt("chat", messages=_messages(v["messages"])),)
        if endpoint == "chat"
        else _prompts(v["prompt"])
    )
    stream = v.get("stream", False)
    opts = v.get("stream_options")
    if opts is not None and not stream:
        raise invalid(
            "'stream_options' is only allowed when 'stream' is true",
            "stream_options",
            "invalid_value",
        )
    session = v.get("session_id") or v.get("prompt_cache_key", "")
    if session_header:
        session = session_field("", required=True).check(session_header, "X-Session-Id")
    return ApiRequest(
        endpoint=endpoint,
        model=v.get("model"),
        prompts=prompts,
        sampling=_sampling(v, limits),
        n=v.get("n", 1),
        stream=stream,
        include_usage=(opts or {}).get("include_usage", False),
        return_token_ids=v.get("return_token_ids", False),
        session_id=session,
        tenant=tenant,
        priority=v.get("priority", 0),
        add_generation_prompt=v.get("add_generation_prompt", True),
        guidance=guidance(v),
        ignored_fields=ignored,
    )
