"""Turn an OpenAI request body into an ``ApiRequest`` or raise a 4xx ``ApiError``.

Every check names the offending ``param`` as OpenAI does, so clients can point at the field.
Unknown fields are ignored (as vLLM does); fields that would silently change the meaning of
the request if ignored (logprobs, tools, penalties, echo...) are rejected as unsupported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.scheduler.errors import ApiError, invalid
from services.scheduler.request import ApiRequest, Endpoint, Message, Prompt, Sampling

ROLES = ("system", "developer", "user", "assistant", "tool")
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_STOP = 16


@dataclass(frozen=True)
class Limits:
    max_n: int = 8
    max_prompts: int = 8
    default_max_tokens: int = 0
    max_messages: int = 2048
    max_tokens: int = INT32_MAX  # the ceiling of max_tokens


MAX_SESSION_ID_CHARS = 256
MAX_JSON_DEPTH = 64


MAX_PRIORITY = 1000  # request and advisory priorities lie in [-1000, 1000]


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


def session_id(value: Any, param: str = "session_id") -> str:
    """A session id as the store keeps it: 1-256 characters of text, no '/', no control
    characters (a header's non-UTF-8 bytes arrive as surrogates and are refused too)."""
    if not isinstance(value, str):
        raise invalid(f"'{param}' must be a string", param, "invalid_type")
    if len(value) > MAX_SESSION_ID_CHARS:
        raise invalid(f"'{param}' may have at most {MAX_SESSION_ID_CHARS} characters",
                      param, "out_of_range")
    if "/" in value or any(ord(ch) < 0x20 or 0xD800 <= ord(ch) <= 0xDFFF or ch == "\x7f"
                           for ch in value):
        raise invalid(f"'{param}' must be UTF-8 text without '/' or control characters",
                      param, "invalid_value")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise invalid(f"'{key}' must be an integer, got {json.dumps(v)}", key, "invalid_type")
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be between {lo} and {hi}, got {v}", key, "out_of_range")
    return v


def _number(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise invalid(f"'{key}' must be a number, got {json.dumps(v)}", key, "invalid_type")
    return float(v)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean, got {json.dumps(v)}", key, "invalid_type")
    return v


def _str(body: dict[str, Any], key: str, default: str) -> str:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(f"'{key}' must be a string, got {json.dumps(v)}", key, "invalid_type")
    return v


def _unsupported(body: dict[str, Any], endpoint: Endpoint) -> None:
    checks = [
        ("logprobs", bool(body.get("logprobs"))),
        ("top_logprobs", bool(body.get("top_logprobs"))),
        ("tools", bool(body.get("tools"))),
        ("functions", bool(body.get("functions"))),
        ("echo", endpoint == "completion" and bool(body.get("echo"))),
        ("suffix", endpoint == "completion" and bool(body.get("suffix"))),
        ("best_of", _is_int(body.get("best_of")) and body["best_of"] > 1),
    ]
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        checks.append((key, v is not None and (not _is_number(v) or v != 0)))
    fmt = body.get("response_format")
    checks.append(
        (
            "response_format",
            fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"),
        )
    )
    for key, bad in checks:
        if bad:
            raise invalid(f"'{key}' is not supported by this server", key, "unsupported_parameter")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if len(items) > MAX_STOP:
        raise invalid(f"'stop' may hold at most {MAX_STOP} strings", "stop", "out_of_range")
    return tuple(items)


def _token_list(v: Any, param: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not v:
        raise invalid(f"'{param}' must be a non-empty list of token ids", param, "invalid_type")
    for t in v:
        if not _is_int(t) or not 0 <= t <= INT32_MAX:
            raise invalid(
                f"'{param}' holds an invalid token id {json.dumps(t)}", param, "invalid_type"
            )
    return tuple(v)


def _sampling(body: dict[str, Any], endpoint: Endpoint, limits: Limits) -> Sampling:
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise invalid(
            f"'temperature' must be between 0 and 2, got {temperature}",
            "temperature",
            "out_of_range",
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"'top_p' must be in (0, 1], got {top_p}", "top_p", "out_of_range")
    top_k = _int(body, "top_k", 0, -1, INT32_MAX)
    max_tokens = _int(body, "max_tokens", None, 1, limits.max_tokens)
    if endpoint == "chat":
        max_tokens = _int(body, "max_completion_tokens", max_tokens, 1, limits.max_tokens)
    seed = _int(body, "seed", None, -INT64_MAX, INT64_MAX)
    stop_ids = body.get("stop_token_ids")
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k or 0, 0),  # -1 (vLLM's "off") and 0 both mean off
        max_tokens=max_tokens if max_tokens is not None else limits.default_max_tokens,
        seed=seed,
        stop=_stop(body),
        stop_token_ids=() if stop_ids is None else _token_list(stop_ids, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos", False),
    )


def _content(v: Any, i: int, role: str) -> str:
    param = f"messages[{i}].content"
    if isinstance(v, str):
        return v
    if v is None and role == "assistant":
        return ""
    if isinstance(v, list):
        texts = []
        for part in v:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f'\'{param}\' parts must be {{"type": "text", "text": string}}',
                    param,
                    "invalid_type",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"'{param}' must be a string or a list of text parts", param, "invalid_type")


def _messages(body: dict[str, Any], limits: Limits) -> tuple[Message, ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise invalid("'messages' must be a list of message objects", "messages", "invalid_type")
    if not msgs:
        raise invalid("'messages' must not be empty", "messages", "empty_array")
    if len(msgs) > limits.max_messages:
        raise invalid(f"'messages' may hold at most {limits.max_messages} messages",
                      "messages", "out_of_range")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"'messages[{i}]' must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(
                f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                f"messages[{i}].role",
                "invalid_value",
            )
        # OpenAI's "developer" is the system message of the templates models ship with.
        out.append(Message("system" if role == "developer" else role,
                           _content(m.get("content"), i, role)))
    return tuple(out)


def _prompts(body: dict[str, Any], limits: Limits) -> tuple[Prompt, ...]:
    p = body.get("prompt")
    if p is None:
        raise invalid("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, str):
        if not p:
            raise invalid("'prompt' must not be empty", "prompt", "empty_string")
        return (Prompt("text", text=p),)
    if not isinstance(p, list) or not p:
        raise invalid(
            "'prompt' must be a non-empty string, list of strings or token ids",
            "prompt",
            "invalid_type",
        )
    if all(_is_int(t) for t in p):
        return (Prompt("tokens", token_ids=_token_list(p, "prompt")),)
    if len(p) > limits.max_prompts:
        raise invalid(
            f"'prompt' may hold at most {limits.max_prompts} prompts", "prompt", "out_of_range"
        )
    out = []
    for item in p:
        if isinstance(item, str) and item:
            out.append(Prompt("text", text=item))
        elif isinstance(item, list):
            out.append(Prompt("tokens", token_ids=_token_list(item, "prompt")))
        else:
            raise invalid(
                "'prompt' list items must be non-empty strings or token id lists",
                "prompt",
                "invalid_type",
            )
    return tuple(out)


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
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid("'model' must be a non-empty string", "model", "invalid_type")
    _unsupported(body, endpoint)
    prompts = (
        (Prompt("chat", messages=_messages(body, limits)),)
        if endpoint == "chat"
        else _prompts(body, limits)
    )
    n = _int(body, "n", 1, 1, limits.max_n)
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _bool(opts or {}, "include_usage", False)
    if opts is not None and not stream:
        raise invalid(
            "'stream_options' is only allowed when 'stream' is true",
            "stream_options",
            "invalid_value",
        )
    session = session_header or _str(body, "session_id", "")
    if session:
        session = session_id(session, "X-Session-Id" if session_header else "session_id")
    return ApiRequest(
        endpoint=endpoint,
        model=model,
        prompts=prompts,
        sampling=_sampling(body, endpoint, limits),
        n=n or 1,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids", False),
        session_id=session,
        tenant=tenant,
        priority=_int(body, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY) or 0,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
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
