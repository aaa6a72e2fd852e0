"""How each model family writes tool calls: the text of a call, the grammar that forces one,
and the parser that reads calls back out of generated text.

    hermes       <tool_call>\n{"name": f, "arguments": {..}}\n</tool_call>
                 (Qwen2, Hermes: the template has <tool_call>; also the fallback)
    llama3_json  {"name": f, "parameters": {..}}, after <|python_tag|> or not
                 (Llama 3.x: the template has <|python_tag|> or ipython)
    mistral      [TOOL_CALLS][{"name": f, "arguments": {..}}, ..]
                 (Mistral: the template has [TOOL_CALLS])

A template that knows nothing of tools gets the hermes preamble and history rendering
(``prompt.py``), so every model can call tools in some format. ``engine.tool_parser``
overrides the choice.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..api_types import ToolCall

# Compact, deterministic JSON as the grammars emit it and the history renders it: the text
# of a call in turn N's output is then the same as in turn N+1's prompt (KV reuse).
KEY_SEP, ITEM_SEP = ": ", ", "
JSON_STYLE = {"whitespace_flexible": False, "key_separator": KEY_SEP, "item_separator": ITEM_SEP}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEP, KEY_SEP))


def new_call_id(family: str = "") -> str:
    """OpenAI-style ``call_…``; Mistral's templates insist on 9 letters and digits."""
    if family == "mistral":
        return uuid.uuid4().hex[:9]
    return "call_" + uuid.uuid4().hex[:24]


def tool_names(tools: tuple[dict, ...]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def closed(schema: Any) -> Any:
    """``schema`` with objects that list their properties closed to others, unless they
    say otherwise: a function takes the parameters it declares (JSON Schema's default of
    open objects lets a forced call write extra keys the function cannot take)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k in _NESTED_LISTS or k == "items" else v)
           for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed(v) for k, v in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_NESTED_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def call_schema(tool: dict, args_key: str) -> dict:
    """JSON schema of one call object ``{"name": <const>, <args_key>: <parameters>}``."""
    fn = tool["function"]
    params = closed(fn.get("parameters") or {"type": "object", "properties": {}})
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": JSON_STYLE,
    }


@dataclass(frozen=True)
class ToolFormat:
    """One family's convention. ``start``/``end`` delimit a call in text (``end`` "" = the
    call runs to the end of the output); ``leads``: characters that, first in the output,
    begin calls even without ``start`` (the marker may be a special token the detokenizer
    drops)."""

    name: str
    start: str
    end: str
    leads: str
    args_key: str

    # ---- writing ------------------------------------------------------------------------
    def call_text(self, calls: tuple[ToolCall, ...]) -> str:
        objs = [{"name": c.name, self.args_key: _args_value(c.arguments)} for c in calls]
        if self.name == "hermes":
            return "\n".join(f"<tool_call>\n{dumps(o)}\n</tool_call>" for o in objs)
        if self.name == "mistral":
            return "[TOOL_CALLS]" + dumps(objs)
        return "; ".join(dumps(o) for o in objs)

    def preamble(self, tools: tuple[dict, ...]) -> str:
        """System text offering ``tools`` to a model whose template cannot."""
        listing = "\n".join(dumps(t) for t in tools)
        example = self.call_text((ToolCall("", "<function name>", '{"<arg>": "<value>"}'),))
        return (
            "You can use the functions below. Each is described by a JSON schema:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, answer with nothing but the call, written as:\n"
            f"{example}\n"
            "Otherwise answer in plain text."
        )

    def grammar(self, tools: tuple[dict, ...], *, parallel: bool, marker: str) -> str:
        """A Lark grammar (llguidance dialect) whose sentences are one or more calls of
        ``tools``; ``marker`` is how the grammar spells ``start`` (a literal or a special
        token reference)."""
        alts = " | ".join(f"fn{i}" for i in range(len(tools)))
        rules = [f"fn{i}: %json {json.dumps(call_schema(t, self.args_key))}"
                 for i, t in enumerate(tools)]
        if self.name == "hermes":
            head = ('start: call ("\\n" call)*' if parallel else "start: call")
            body = [f'call: {marker} "\\n" ({alts}) "\\n</tool_call>"']
        elif self.name == "mistral":
            more = f' ({json.dumps(ITEM_SEP)} ({alts}))*' if parallel else ""
            head = f'start: {marker} "[" ({alts}){more} "]"'
            body = []
        else:
            head = f"start: {alts}" + (f' ({json.dumps("; ")} ({alts}))*' if parallel else "")
            body = []
        return "\n".join([head, *body, *rules])

    # ---- reading ------------------------------------------------------------------------
    def parse_block(self, block: str, names: list[str]) -> list[ToolCall] | None:
        """The calls in one delimited block (or the output's tail), or None when it is not
        a valid call of a known function (the text then stays content)."""
        text = block.strip()
        if self.name == "llama3_json":
            parts = [p for p in re.split(r"\s*;\s*(?=\{)", text) if p]
            objs: list[Any] = []
            for p in parts:
                o = _load(p)
                if o is None:
                    return None
                objs.append(o)
        else:
            o = _load(text)
            if o is None:
                return None
            objs = o if isinstance(o, list) else [o]
        calls = []
        for o in objs:
            call = self._call(o, names)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def _call(self, o: Any, names: list[str]) -> ToolCall | None:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return None
        if names and o["name"] not in names:
            return None
        args = o.get(self.args_key, o.get("arguments", o.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _load(args)
        if not isinstance(args, dict):
            return None
        return ToolCall(new_call_id(self.name), o["name"], dumps(args))


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _args_value(arguments: str) -> Any:
    """Arguments as the templates want them: an object when the JSON text parses."""
    value = _load(arguments) if arguments else {}
    return value if value is not None else arguments


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "", "arguments"),
    "llama3_json": ToolFormat("llama3_json", "<|python_tag|>", "", "{", "parameters"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", "[", "arguments"),
}


def detect(template_source: str | None, override: str = "") -> ToolFormat:
    """The family for a chat template (``override``: a name from FORMATS)."""
    if override:
        return FORMATS[override]
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return FORMATS["mistral"]
    if "<|python_tag|>" in src or "ipython" in src:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
