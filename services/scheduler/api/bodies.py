"""The public API's request bodies as schema nodes (``schema.py``): what ``validation.py``
and the advisory route check, and what ``/openapi.json`` publishes. Limits that come from
the configuration (``n``, ``max_tokens``, messages, prompts: ``limits.py``) are built in
per server.
"""

from __future__ import annotations

import functools

from services.scheduler.api.errors import invalid
from services.scheduler.api.limits import Limits
from services.scheduler.api.request import Endpoint
from services.scheduler.api.schema import (
    AnyOf,
    Bool,
    Int,
    JsonObject,
    ListOf,
    MapOf,
    Node,
    Num,
    Obj,
    Str,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_STOP = 16
MAX_PRIORITY = 1000  # request and advisory priorities lie in [-1000, 1000]
MAX_SESSION_ID_CHARS = 256
MAX_SUCCESSORS = 16
MAX_ARRIVAL_S = 3600.0
SESSION_PATTERN = r"^[^/\x00-\x1f\x7f]*$"


def session_rule(value: str, param: str) -> str:
    """1-256 characters of text, no '/', no control characters (a header's non-UTF-8
    bytes arrive as lone surrogates, refused too)."""
    if "/" in value or any(ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF
                           for ch in value):
        raise invalid(f"'{param}' must be UTF-8 text without '/' or control characters",
                      param, "invalid_value")
    return value


def session_field(doc: str, required: bool = False) -> Str:
    return Str(doc, min_len=1 if required else 0, max_len=MAX_SESSION_ID_CHARS,
               pattern=SESSION_PATTERN, rule=session_rule)


MODEL = Str("a served model's name (GET /v1/models); absent: the cluster's first model",
            min_len=1)
TOKEN_ID = Int(0, INT32_MAX)
TOKEN_IDS = ListOf(TOKEN_ID, min_items=1, what="token ids")
TEXT_PART = Obj({"type": Str(enum=("text",)), "text": Str()}, required=("type", "text"))
CONTENT = AnyOf([Str(), ListOf(TEXT_PART, what='{"type": "text", "text": string} parts')],
                "a string or a list of text parts",
                "the message's text (null only for an assistant message)")
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


def function_name_rule(value: str, param: str) -> str:
    if not all(c.isascii() and (c.isalnum() or c in "_.-") for c in value):
        raise invalid(f"'{param}' may hold only letters, digits, '_', '.' and '-'", param,
                      "invalid_value")
    return value


FUNCTION_NAME = Str("a function's name", min_len=1, max_len=64, pattern=FUNCTION_NAME_PATTERN,
                    rule=function_name_rule)
TOOL_CALL = Obj({
    "id": Str(),
    "type": Str(enum=("function",)),
    "function": Obj({"name": FUNCTION_NAME, "arguments": Str("the arguments as JSON text")},
                    required=("name", "arguments")),
}, required=("function",))
MESSAGE = Obj({"role": Str(enum=ROLES, doc="'developer' is read as 'system'"),
               "content": CONTENT, "name": Str(),
               "tool_calls": ListOf(TOOL_CALL, what="tool call objects",
                                    doc="an assistant's calls"),
               "tool_call_id": Str(doc="a tool message: the call it answers")},
              required=("role",))
FUNCTION = Obj({
    "name": FUNCTION_NAME,
    "description": Str(),
    "parameters": JsonObject("the arguments' JSON schema"),
    "strict": Bool(default=False),
}, required=("name",))
TOOL = Obj({"type": Str(enum=("function",)), "function": FUNCTION}, required=("type", "function"))
MAX_TOOLS = 128
TOOLS = ListOf(TOOL, max_items=MAX_TOOLS, what="tool objects",
               doc="functions the model may call (rendered by its chat template)")
TOOL_CHOICE = AnyOf([
    Str(enum=("none", "auto", "required")),
    Obj({"type": Str(enum=("function",)),
         "function": Obj({"name": FUNCTION_NAME}, required=("name",))},
        required=("type", "function")),
], '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "required and a named function are enforced while sampling")
RESPONSE_FORMAT = Obj({
    "type": Str(enum=("text", "json_object", "json_schema")),
    "json_schema": Obj({"name": Str(min_len=1), "description": Str(),
                        "schema": JsonObject("the JSON schema the output follows"),
                        "strict": Bool(default=False)}, required=("name",)),
}, required=("type",), doc="json_object and json_schema are enforced while sampling")
STOP = AnyOf([Str(min_len=1), ListOf(Str(min_len=1), min_items=1, max_items=MAX_STOP)],
             f"a non-empty string or a list of at most {MAX_STOP} of them",
             "text that ends a choice (not included in it)")


# OpenAI's prompt caching fields (issue 41): a session key when no session is named, and
# how long the session's KV is kept (``scheduler.retention_max_s`` bounds it).
CACHE_FIELDS: dict[str, Node] = {
    "prompt_cache_key": session_field("the session when neither X-Session-Id nor "
                                      "session_id names one"),
    "prompt_cache_retention": Str("how long the session's KV is kept", enum=("in_memory",
                                                                              "24h")),
}


def _sampling(limits: Limits, chat: bool) -> dict[str, Node]:
    fields = {
        "model": MODEL,
        "max_tokens": Int(1, limits.max_tokens, "tokens to generate at most; absent: up to "
                          "the context (or the server's default)"),
        "temperature": Num(0.0, 2.0, "0 = greedy", default=1.0),
        "top_p": Num(0.0, 1.0, "nucleus sampling", default=1.0, lo_open=True),
        "top_k": Int(-1, INT32_MAX, "-1 or 0: off", default=0),
        "n": Int(1, limits.max_n, "choices per prompt", default=1),
        "seed": Int(-INT64_MAX, INT64_MAX, "reproducible sampling (choice i uses seed + i)"),
        "stop": STOP,
        "stop_token_ids": TOKEN_IDS,
        "ignore_eos": Bool(default=False),
        "stream": Bool("server-sent events, one chunk per token batch", default=False),
        "stream_options": Obj({"include_usage": Bool(default=False)},
                              doc="only with stream: true"),
        "return_token_ids": Bool("add token_ids and prompt_token_ids to each choice",
                                 default=False),
        "session_id": session_field("the conversation; its KV is reused across turns (the "
                                    "X-Session-Id header wins)"),
        "priority": Int(-MAX_PRIORITY, MAX_PRIORITY, "higher first under load", default=0),
        **CACHE_FIELDS,
    }
    if chat:
        fields["max_completion_tokens"] = Int(1, limits.max_tokens, "as max_tokens (wins)")
        fields["add_generation_prompt"] = Bool(default=True)
        fields["tools"] = TOOLS
        fields["tool_choice"] = TOOL_CHOICE
        fields["parallel_tool_calls"] = Bool(default=True)
    fields["response_format"] = RESPONSE_FORMAT
    fields.update(_controls(limits, chat))
    return fields


# ---- sampling controls, log-probabilities and the fields OpenAI documents (issue 45) -----
MAX_LOGIT_BIAS = 1024


def _controls(limits: Limits, chat: bool) -> dict[str, Node]:
    fields: dict[str, Node] = {
        "presence_penalty": Num(-2.0, 2.0, "OpenAI's: minus this for every token already in "
                                "the output", default=0.0),
        "frequency_penalty": Num(-2.0, 2.0, "OpenAI's: minus this times each token's count "
                                 "in the output", default=0.0),
        "repetition_penalty": Num(0.0, 10.0, "vLLM's: logits of tokens in the prompt or the "
                                  "output divided (positive) or multiplied by it; 1 = off",
                                  default=1.0, lo_open=True),
        "min_p": Num(0.0, 1.0, "vLLM's: drop tokens less likely than min_p times the most "
                     "likely; 0 = off", default=0.0),
        "logit_bias": MapOf(Num(-100.0, 100.0), INT32_MAX, MAX_LOGIT_BIAS,
                            "token id -> bias added to its logit"),
        "min_tokens": Int(0, limits.max_tokens, "vLLM's: no EOS or stop token id before "
                          "this many output tokens (at most max_tokens)", default=0),
        "user": Str("accepted, no effect on the output"),
    }
    if chat:
        fields["logprobs"] = Bool("the log-probability of each output token", default=False)
        fields["top_logprobs"] = Int(0, 20, "with logprobs: the most likely tokens at each "
                                     "position")
        for name in ("metadata",):
            fields[name] = JsonObject("accepted, no effect on the output")
        fields["store"] = Bool("accepted, no effect on the output (nothing is stored)")
        fields["service_tier"] = Str("accepted, no effect on the output")
        fields["safety_identifier"] = Str("accepted, no effect on the output")
    else:
        fields["logprobs"] = Int(0, 5, "the log-probability of each output token and this "
                                 "many most likely alternatives")
        fields["echo"] = Bool("the prompt first in the text (and its tokens' "
                              "log-probabilities, with logprobs)", default=False)
        fields["best_of"] = Int(1, 1, "only 1 (more is refused)", default=1)
        fields["suffix"] = Str("only empty (more is refused)", max_len=0)
    return fields


# OpenAI documents these but they would change the output in ways this server cannot do:
# refused with 400 unsupported_parameter when set (validation.py).
REFUSED = {"chat": ("functions", "function_call", "audio", "modalities", "prediction",
                    "web_search_options", "reasoning_effort", "verbosity"),
           "completion": ("tools", "functions")}
UNSUPPORTED = ("functions and function_call (the old form of tools), audio, non-text "
               "modalities, prediction, web_search_options, reasoning_effort, verbosity, "
               "best_of > 1, a non-empty suffix (and tools for completions) are refused with "
               "400 unsupported_parameter; fields nobody documents are ignored and named in "
               "the X-Overture-Ignored-Fields header (400 under scheduler.strict_fields)")


def chat_body(limits: Limits) -> Obj:
    return Obj({**_sampling(limits, chat=True),
                "messages": ListOf(MESSAGE, min_items=1, max_items=limits.max_messages,
                                   what="message objects")},
               required=("messages",), doc=f"An OpenAI chat completion request. "
               f"{UNSUPPORTED}.")


def completion_body(limits: Limits) -> Obj:
    prompt = AnyOf([
        Str(min_len=1), TOKEN_IDS,
        ListOf(AnyOf([Str(min_len=1), TOKEN_IDS], "a non-empty string or token id list"),
               min_items=1, max_items=limits.max_prompts, what="prompts")],
        f"a non-empty string, a list of token ids, or a list of at most "
        f"{limits.max_prompts} of either", "one prompt, or several (each fans out n choices)")
    return Obj({**_sampling(limits, chat=False), "prompt": prompt}, required=("prompt",),
               doc=f"An OpenAI completion request. {UNSUPPORTED}.")


@functools.lru_cache(maxsize=8)
def body_schema(endpoint: Endpoint, limits: Limits) -> Obj:
    """The body of ``endpoint`` under ``limits`` (built once per server's limits)."""
    return chat_body(limits) if endpoint == "chat" else completion_body(limits)


ARRIVAL = Num(0.0, MAX_ARRIVAL_S, "seconds until the request is expected", default=0.0)
SUCCESSOR = Obj({"session_id": session_field("the successor's session", required=True),
                 "model": Str(min_len=1), "expected_arrival_s": ARRIVAL},
                required=("session_id", "model"), closed=True)
ADVISORY = Obj({
    "session_id": session_field("the session whose next request is coming", required=True),
    "model": Str("the model it will use", min_len=1),
    "expected_arrival_s": ARRIVAL,
    "priority": Int(-MAX_PRIORITY, MAX_PRIORITY, "high: prefetched straight into device "
                    "memory by the priority policy", default=0),
    "successors": ListOf(SUCCESSOR, max_items=MAX_SUCCESSORS, what="successor objects",
                         doc="sessions that may run next (an agent graph's branches)"),
}, required=("session_id", "model"), closed=True,
    doc="An advisory: a request of this session is coming; its KV is moved into place.")
