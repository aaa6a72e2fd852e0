"""A request body as bytes becomes a JSON object, or a 4xx ``ApiError``: within the size
limit (413), nested no deeper than ``MAX_JSON_DEPTH`` (refused before the parser recurses),
strict JSON (no NaN or Infinity) and text (no lone surrogates). What the object must hold
is the schemas' business (``bodies.py``, ``validation.py``)."""

from __future__ import annotations

import json
from typing import Any

from services.scheduler.api.errors import ApiError, invalid

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


def check_body_size(length: int | None, limit: int) -> None:
    """413 for a body whose announced length is over ``limit`` (aiohttp enforces the limit
    itself for bodies without a Content-Length)."""
    if length is not None and length > limit:
        raise ApiError(
            413,
            f"request body of {length} bytes exceeds the limit of {limit} bytes",
            code="body_too_large",
        )
