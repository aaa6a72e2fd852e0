"""The body of ``POST /v1/responses`` as schema nodes (published in /openapi.json)."""

from __future__ import annotations

import functools

from services.scheduler.api.bodies import (
    CACHE_FIELDS,
    FUNCTION_NAME,
    MAX_TOOLS,
    MODEL,
    session_field,
)
from services.scheduler.api.limits import Limits
from services.scheduler.api.schema import AnyOf, Bool, Int, JsonObject, ListOf, Num, Obj, Str

PART = Obj({"type": Str(enum=("input_text", "output_text", "text", "refusal")),
            "text": Str(), "refusal": Str()}, required=("type",))
TEXT = AnyOf([Str(), ListOf(PART, what="content parts")], "a string or a list of text parts")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ITEM = Obj({
    "type": Str(enum=ITEM_TYPES, doc="absent: a message"),
    "role": Str(enum=("user", "system", "developer", "assistant")),
    "content": TEXT,
    "call_id": Str(min_len=1),
    "name": FUNCTION_NAME,
    "arguments": Str(),
    "output": TEXT,
}, doc="a message, a function call the model made, or a function's output")
TOOL = Obj({
    "type": Str(enum=("function",)),
    "name": FUNCTION_NAME,
    "description": Str(),
    "parameters": JsonObject("the arguments' JSON schema"),
    "strict": Bool(default=False),
}, required=("type", "name"))
TOOL_CHOICE = AnyOf([
    Str(enum=("none", "auto", "required")),
    Obj({"type": Str(enum=("function",)), "name": FUNCTION_NAME}, required=("type", "name")),
], '"none", "auto", "required" or {"type": "function", "name": ...}')
FORMAT = Obj({
    "type": Str(enum=("text", "json_object", "json_schema")),
    "name": Str(), "description": Str(), "schema": JsonObject(), "strict": Bool(default=False),
}, required=("type",))


@functools.lru_cache(maxsize=4)
def responses_body(limits: Limits) -> Obj:
    return Obj({
        "model": MODEL,
        "input": AnyOf([Str(min_len=1), ListOf(ITEM, min_items=1, max_items=limits.max_messages,
                                               what="input items")],
                       "a non-empty string or a list of input items"),
        "instructions": Str(doc="a system message before the conversation (not inherited "
                            "through previous_response_id)"),
        "previous_response_id": Str(min_len=1, doc="continue that response's conversation"),
        "tools": ListOf(TOOL, max_items=MAX_TOOLS, what="function tools"),
        "tool_choice": TOOL_CHOICE,
        "parallel_tool_calls": Bool(default=True),
        "text": Obj({"format": FORMAT}),
        "max_output_tokens": Int(1, limits.max_tokens),
        "temperature": Num(0.0, 2.0, default=1.0),
        "top_p": Num(0.0, 1.0, default=1.0, lo_open=True),
        "seed": Int(-(2**63 - 1), 2**63 - 1),
        "stream": Bool(default=False),
        "store": Bool("keep the response for previous_response_id and GET", default=True),
        "metadata": JsonObject(),
        "session_id": session_field("the session (default: the chain's first response id)"),
        **CACHE_FIELDS,
        "priority": Int(-1000, 1000, default=0),
    }, required=("input",), doc="An OpenAI Responses API request: text and function "
       "tools; other tool types, files and images are refused.")
