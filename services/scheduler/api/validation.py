"""Turn an OpenAI request body into an ``ApiRequest`` or raise a 4xx ``ApiError``.

Types and ranges are checked by the bodies' schemas (``api_schema.py``, which
``/openapi.json`` publishes); what a schema cannot say is checked here. Every check names
the offending ``param`` as OpenAI does, so clients can point at the field. Unknown fields
are ignored (as vLLM does); fields that would silently change the meaning of the request
if ignored (logprobs, tools, penalties, echo...) are rejected as unsupported.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from services.scheduler.api.bodies import (
    INT32_MAX,
    chat_body,
    completion_body,
    session_field,
)
from services.scheduler.api.errors import ApiError, invalid
from services.scheduler.api.request import (
    ApiRequest,
    Endpoint,
    Guidance,
    Message,
    Prompt,
    Sampling,
    ToolCall,
)
from services.scheduler.api.schema import Obj, is_int, is_number


@dataclass(frozen=True)
class Limits:
    max_n: int = 8
    max_prompts: int = 8
    default_max_tokens: int = 0
    max_messages: int = 2048
    max_tokens: int = INT32_MAX  # the ceiling of max_tokens


MAX_JSON_DEPTH = 64



def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body; it must be a JSON object (NaN/Infinity are not JSON)."""
    if _nesting(raw) > MAX_JSON_DEPTH:
        raise invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                      code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
        # A lone surrogate ("\ud800") is valid JSON escaping but no text: refuse it here,
        # not when the prompt is encoded further down.
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise invalid("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): "
                      "not text", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise invalid(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(
            f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body


def _nesting(raw: bytes) -> int:
    """How deep ``[``/``{`` nest outside strings (an upper bound good enough to refuse a
    body before the parser recurses into it)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    depth = deepest = 0
    in_string = escaped = False
    for c in raw:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D):
            depth -= 1
    return deepest




def _unsupported(body: dict[str, Any], endpoint: Endpoint) -> None:
    checks = [
        ("logprobs", bool(body.get("logprobs"))),
        ("top_logprobs", bool(body.get("top_logprobs"))),
        ("tools", endpoint == "completion" and bool(body.get("tools"))),
        ("functions", bool(body.get("functions"))),
        ("echo", endpoint == "completion" and bool(body.get("echo"))),
        ("suffix", endpoint == "completion" and bool(body.get("suffix"))),
        ("best_of", is_int(body.get("best_of")) and body["best_of"] > 1),
    ]
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        checks.append((key, v is not None and (not is_number(v) or v != 0)))
    for key, bad in checks:
        if bad:
            raise invalid(f"'{key}' is not supported by this server", key, "unsupported_parameter")


@functools.lru_cache(maxsize=8)
def body_schema(endpoint: Endpoint, limits: Limits) -> Obj:
    return chat_body(limits) if endpoint == "chat" else completion_body(limits)


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
    )


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
    session = v.get("session_id", "")
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
    )


# No tokenizer packs more characters than this into one token on average: a prompt with
# more characters than this many times the context cannot fit, and is refused before a
# node spends seconds tokenizing megabytes of it.
CHARS_PER_TOKEN_BOUND = 32


def check_prompt_length(req: ApiRequest, max_model_len: int) -> None:
    """400 for a prompt that cannot fit ``max_model_len`` tokens (0: not known yet)."""
    if max_model_len <= 0:
        return
    for p in req.prompts:
        if p.kind == "tokens":
            size, unit, bound = len(p.token_ids), "tokens", max_model_len
        else:
            size = len(p.text) + sum(len(m.content) for m in p.messages)
            unit, bound = "characters", max_model_len * CHARS_PER_TOKEN_BOUND
        if size > bound:
            param = "messages" if p.kind == "chat" else "prompt"
            raise invalid(f"the prompt has {size} {unit}, far more than the model's context "
                          f"of {max_model_len} tokens holds", param, "context_length_exceeded")


def check_body_size(length: int | None, limit: int) -> None:
    if length is not None and length > limit:
        raise ApiError(
            413,
            f"request body of {length} bytes exceeds the limit of {limit} bytes",
            code="body_too_large",
        )
