"""``GET /openapi.json``: the public API described as OpenAPI 3.1.

Request bodies come from the very schemas the server validates with (``bodies.py``,
built with this server's limits), so the description cannot drift from the checks. The
responses are written here beside the code that produces them (``openai_format.py``);
tests check real responses against them, and the fuzz test (schemathesis) checks every
answer it provokes.
"""

from __future__ import annotations

from typing import Any

from services.scheduler.api.bodies import ADVISORY, body_schema
from services.scheduler.api.limits import Limits
from services.scheduler.api.responses_body import responses_body

_INT = {"type": "integer"}
_STR = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": _INT}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                        "prompt_tokens_details": {"type": "object", "properties": {
                            "cached_tokens": _INT}}}}
# One server-sent event as a client parses it (``data`` holds a JSON object or [DONE]).
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": _STR, "event": _STR, "id": _STR, "retry": _INT}}
_FINISH = {"type": "string", "enum": ["stop", "length", "abort", "tool_calls"]}
TOOL_CALLS = {"type": "array", "items": {
    "type": "object", "required": ["id", "type", "function"], "properties": {
        "id": _STR, "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name", "arguments"],
            "properties": {"name": _STR, "arguments": _STR}}}}}


_NUM = {"type": "number"}
_BYTES = {"type": "array", "items": _INT}
_TOP_FIELDS: dict[str, Any] = {"token": _STR, "logprob": _NUM, "bytes": _BYTES}
_TOP = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": _TOP_FIELDS}
# choices[].logprobs: null unless asked for; chat's shape or the legacy one (api.md).
CHAT_LOGPROBS = {"anyOf": [{"type": "null"}, {
    "type": "object", "required": ["content"], "properties": {"content": {
        "type": "array", "items": {**_TOP, "properties": {
            **_TOP_FIELDS, "top_logprobs": {"type": "array", "items": _TOP}}}}}}]}
LEGACY_LOGPROBS = {"anyOf": [{"type": "null"}, {
    "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {"tokens": {"type": "array", "items": _STR},
                   "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                   "top_logprobs": {"type": "array", "items": {
                       "anyOf": [{"type": "null"},
                                 {"type": "object", "additionalProperties": _NUM}]}},
                   "text_offset": {"type": "array", "items": _INT}}}]}
IGNORED_HEADER = {"X-Overture-Ignored-Fields": {
    "description": "request fields nobody documents, ignored (comma-separated)",
    "schema": _STR}}


def _completion(chat: bool) -> dict[str, Any]:
    out = ({"message": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
        "tool_calls": TOOL_CALLS}}} if chat else {"text": _STR})
    choice = {"type": "object", "required": ["index", "finish_reason", *out],
              "properties": {"index": _INT, "finish_reason": _FINISH,
                             "logprobs": CHAT_LOGPROBS if chat else LEGACY_LOGPROBS,
                             "token_ids": _TOKEN_IDS, "prompt_token_ids": _TOKEN_IDS,
                  **out}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices",
                                           "usage"],
            "properties": {"id": _STR, "object": {
                "const": "chat.completion" if chat else "text_completion"},
                "created": _INT, "model": _STR,
                "choices": {"type": "array", "items": choice}, "usage": USAGE}}


MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "owned_by"], "properties": {
            "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
            "max_model_len": _INT}}}}}
_ADVISED: dict[str, Any] = {
    "type": "object", "required": ["advisory_id", "object", "session_id", "node", "expires_at"],
            "properties": {"advisory_id": _STR, "object": {"const": "advisory"},
                           "session_id": _STR, "node": _STR, "expires_at": {"type": "number"}}}
ADVISED = {**_ADVISED, "required": [*_ADVISED["required"], "successors"],
           "properties": {**_ADVISED["properties"],
                          "successors": {"type": "array", "items": _ADVISED}}}
DELETED = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
    "id": _STR, "object": {"const": "advisory"}, "deleted": {"const": True}}}
_ITEM = {"type": "object", "required": ["id", "type", "status"], "properties": {
    "id": _STR, "type": {"enum": ["message", "function_call"]}, "status": _STR,
    "role": {"const": "assistant"}, "content": {"type": "array"}, "call_id": _STR,
    "name": _STR, "arguments": _STR}}
RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model",
                                           "output"],
            "properties": {"id": _STR, "object": {"const": "response"}, "created_at": _INT,
                           "status": {"enum": ["completed", "incomplete", "in_progress",
                                               "failed"]},
                           "model": _STR, "output": {"type": "array", "items": _ITEM},
                           "previous_response_id": {"type": ["string", "null"]},
                           "session_id": _STR,
                           "usage": {"type": ["object", "null"], "properties": {
                               "input_tokens": _INT, "output_tokens": _INT,
                               "total_tokens": _INT}}}}
_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": _STR}]

_ERRORS = {str(code): {"description": why, "content": {"application/json": {"schema": ERROR}}}
           for code, why in ((400, "malformed request"), (401, "missing or unknown API key"),
                             (403, "this key may not use the route"),
                             (404, "unknown model or advisory"), (408, "body too slow"),
                             (413, "body too large"),
                             (429, "over a limit or every node busy (see Retry-After)"),
                             (503, "no healthy node serves the model"))}


def _json(schema: dict[str, Any], why: str) -> dict[str, Any]:
    return {"description": why, "content": {"application/json": {"schema": schema}}}


def _streamed(schema: dict[str, Any], why: str) -> dict[str, Any]:
    """JSON, or server-sent events with ``stream: true``."""
    ok = _json(schema, why)
    ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    return ok


def _generation(chat: bool, limits: Limits) -> dict[str, Any]:
    endpoint = "chat" if chat else "completion"
    ok = _streamed(_completion(chat), "the completion (with stream: server-sent events of "
                   "chunks, then data: [DONE])")
    ok["headers"] = IGNORED_HEADER
    return {"post": {
        "summary": "OpenAI chat completion" if chat else "OpenAI completion",
        "parameters": [{"name": "X-Session-Id", "in": "header", "required": False,
                        "schema": {"type": "string", "maxLength": 256}}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": body_schema(endpoint, limits).schema()}}},
        "responses": {"200": ok, **_ERRORS}}}


def _page(media: str, why: str) -> dict[str, Any]:
    return {"get": {"security": [], "responses": {"200": {
        "description": why, "content": {media: {"schema": _STR}}}}}}


def openapi_document(limits: Limits) -> dict[str, Any]:
    health = {"get": {"security": [], "responses": {
        "200": _json({"type": "object"}, "up"), "503": _json({"type": "object"}, "not ready")}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Overture", "version": "1",
                 "description": "OpenAI-compatible serving with advisory requests."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _generation(True, limits),
            "/v1/completions": _generation(False, limits),
            "/v1/models": {"get": {"responses": {"200": _json(MODELS, "served models"),
                                                 **_ERRORS}}},
            "/v1/advisory": {"post": {
                "summary": "advise that a session's request is coming",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": ADVISORY.schema()}}},
                "responses": {"202": _json(ADVISED, "accepted: the KV moves into place"),
                              **_ERRORS}}},
            "/v1/advisory/{advisory_id}": {"delete": {
                "parameters": [{"name": "advisory_id", "in": "path", "required": True,
                                "schema": _STR}],
                "responses": {"200": _json(DELETED, "invalidated"), **_ERRORS}}},
            "/v1/responses": {"post": {
                "summary": "OpenAI Responses API (text and function tools)",
                "parameters": [{"name": "X-Session-Id", "in": "header", "required": False,
                                "schema": {"type": "string", "maxLength": 256}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": responses_body(limits).schema()}}},
                "responses": {"200": _streamed(RESPONSE, "the response (with stream: "
                                               "server-sent Responses events)"), **_ERRORS}}},
            "/v1/responses/{response_id}": {
                "get": {"parameters": _RESPONSE_ID,
                        "responses": {"200": _json(RESPONSE, "a stored response"), **_ERRORS}},
                "delete": {"parameters": _RESPONSE_ID, "responses": {
                    "200": _json({"type": "object"}, "deleted"), **_ERRORS}}},
            "/healthz": health,
            "/readyz": health,
            "/leaderz": health,  # (503: a standby replica)
            "/openapi.json": {"get": {"security": [], "responses": {
                "200": _json({"type": "object"}, "this document")}}},
            "/": _page("text/html", "the demo chat page"),
            "/static/overture-widget.js": _page("text/javascript", "the chat widget (ES module)"),
            **_operator_routes(),
        },
    }


def _operator_routes() -> dict[str, Any]:
    """Routes for admin keys (``scheduler.admin_keys``)."""
    node = [{"name": "node_id", "in": "path", "required": True, "schema": _STR}]
    obj = {"type": "object"}
    return {
        "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text", "content": {
            "text/plain": {"schema": _STR}}}, **_ERRORS}}},
        "/admin/nodes": {"get": {"responses": {"200": _json(obj, "every node"), **_ERRORS}}},
        "/admin/nodes/{node_id}/drain": {"post": {"parameters": node, "responses": {
            "200": _json(obj, "drained"), **_ERRORS}}},
        "/admin/nodes/{node_id}/undrain": {"post": {"parameters": node, "responses": {
            "200": _json(obj, "back in rotation"), **_ERRORS}}},
        "/admin/sessions/{session_id}": {"get": {"parameters": [
            {"name": "session_id", "in": "path", "required": True, "schema": _STR},
            {"name": "tenant", "in": "query", "required": False, "schema": _STR}],
            "responses": {"200": _json(obj, "where the session's KV is"), **_ERRORS}}},
    }
