"""Request-body schemas that check a body and describe it, from one definition.

Each node validates a decoded JSON value (``check``: the value as the server uses it, or a
400 ``ApiError`` naming the field as OpenAI does, e.g. ``messages[2].content``) and
renders itself as JSON Schema (``schema``). The public API's bodies are built from these
(``bodies.py``), so ``/openapi.json`` describes exactly what the validation accepts:
there is no second description to keep in step by hand.

A JSON ``null`` counts as an absent field, as OpenAI's API treats it.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.api.errors import ApiError, invalid


def _got(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


class Node(ABC):
    doc: str = ""

    @abstractmethod
    def check(self, v: Any, param: str) -> Any:
        """``v`` as the server uses it, or a 400 ``ApiError`` naming ``param``."""

    @abstractmethod
    def schema(self) -> dict[str, Any]:
        """This node as JSON Schema."""

    def _described(self, s: dict[str, Any]) -> dict[str, Any]:
        """``s`` with this node's description and default (where it has them)."""
        default = getattr(self, "default", None)
        if default is not None:
            s = {**s, "default": default}
        return {**s, "description": self.doc} if self.doc else s


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


@dataclass
class Num(Node):
    """A number in [lo, hi] (``lo_open``: (lo, hi]); with ``integer``, a whole one (2.0 is
    taken as 2)."""

    lo: float
    hi: float
    doc: str = ""
    default: float | None = None
    lo_open: bool = False
    integer: bool = False

    def check(self, v: Any, param: str) -> Any:
        if self.integer and isinstance(v, float) and v.is_integer():
            v = int(v)
        if not (is_int(v) if self.integer else is_number(v)):
            kind = "an integer" if self.integer else "a number"
            raise invalid(f"'{param}' must be {kind}, got {_got(v)}", param, "invalid_type")
        if not (self.lo < v if self.lo_open else self.lo <= v) or v > self.hi:
            lo, hi = _bound(self.lo), _bound(self.hi)
            bounds = f"in ({lo}, {hi}]" if self.lo_open else f"between {lo} and {hi}"
            raise invalid(f"'{param}' must be {bounds}, got {v}", param, "out_of_range")
        return int(v) if self.integer else float(v)

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "integer" if self.integer else "number",
                             "maximum": self.hi}
        s["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        return self._described(s)


def Int(lo: int, hi: int, doc: str = "", default: int | None = None) -> Num:
    """A whole number in [lo, hi]."""
    return Num(lo, hi, doc, default, integer=True)


def _bound(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass
class Bool(Node):
    doc: str = ""
    default: bool | None = None

    def check(self, v: Any, param: str) -> bool:
        if not isinstance(v, bool):
            raise invalid(f"'{param}' must be a boolean, got {_got(v)}", param, "invalid_type")
        return v

    def schema(self) -> dict[str, Any]:
        return self._described({"type": "boolean"})


@dataclass
class Str(Node):
    doc: str = ""
    min_len: int = 0
    max_len: int | None = None
    pattern: str | None = None  # documented; ``rule`` enforces it
    rule: Callable[[str, str], str] | None = None  # (value, param) -> value, or raises
    enum: Sequence[str] | None = None

    def check(self, v: Any, param: str) -> str:
        if not isinstance(v, str):
            raise invalid(f"'{param}' must be a string, got {_got(v)}", param, "invalid_type")
        if self.enum is not None and v not in self.enum:
            raise invalid(f"'{param}' must be one of {', '.join(self.enum)}, got {_got(v)}",
                          param, "invalid_value")
        if len(v) < self.min_len:
            raise invalid(f"'{param}' must not be empty" if self.min_len == 1 else
                          f"'{param}' needs at least {self.min_len} characters", param,
                          "empty_string" if self.min_len == 1 else "out_of_range")
        if self.max_len is not None and len(v) > self.max_len:
            raise invalid(f"'{param}' may have at most {self.max_len} characters", param,
                          "out_of_range")
        return self.rule(v, param) if self.rule is not None else v

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "string"}
        if self.enum is not None:
            s["enum"] = list(self.enum)
        if self.min_len:
            s["minLength"] = self.min_len
        if self.max_len is not None:
            s["maxLength"] = self.max_len
        if self.pattern:
            s["pattern"] = self.pattern
        return self._described(s)


@dataclass
class ListOf(Node):
    item: Node
    min_items: int = 0
    max_items: int | None = None
    doc: str = ""
    what: str = "items"  # in messages: "a list of <what>"

    def check(self, v: Any, param: str) -> list[Any]:
        if not isinstance(v, list):
            raise invalid(f"'{param}' must be a list of {self.what}", param, "invalid_type")
        if len(v) < self.min_items:
            raise invalid(f"'{param}' must not be empty", param, "empty_array")
        if self.max_items is not None and len(v) > self.max_items:
            raise invalid(f"'{param}' may hold at most {self.max_items} {self.what}", param,
                          "out_of_range")
        return [self.item.check(x, f"{param}[{i}]") for i, x in enumerate(v)]

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "array", "items": self.item.schema()}
        if self.min_items:
            s["minItems"] = self.min_items
        if self.max_items is not None:
            s["maxItems"] = self.max_items
        return self._described(s)


@dataclass
class AnyOf(Node):
    """The first option that accepts the value wins; none: one error for the field."""

    options: Sequence[Node]
    expected: str  # "a string or a list of strings"
    doc: str = ""

    def check(self, v: Any, param: str) -> Any:
        for option in self.options:
            try:
                return option.check(v, param)
            except ApiError:  # (not this shape: try the next)
                continue
        raise invalid(f"'{param}' must be {self.expected}", param, "invalid_type")

    def schema(self) -> dict[str, Any]:
        return self._described({"anyOf": [o.schema() for o in self.options]})


@dataclass
class JsonObject(Node):
    """Any JSON object, kept whole (a JSON schema, a function's parameters)."""

    doc: str = ""

    def check(self, v: Any, param: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise invalid(f"'{param}' must be an object", param, "invalid_type")
        return v

    def schema(self) -> dict[str, Any]:
        return self._described({"type": "object"})


@dataclass
class Obj(Node):
    fields: Mapping[str, Node]
    required: Sequence[str] = ()
    doc: str = ""
    closed: bool = False  # unknown fields are an error (else ignored, as vLLM does)
    extra: Mapping[str, Any] = field(default_factory=dict)  # more schema, e.g. examples

    def check(self, v: Any, param: str = "") -> dict[str, Any]:
        if not isinstance(v, dict):
            where = f"'{param}'" if param else "request body"
            raise invalid(f"{where} must be an object", param or None, "invalid_type")
        if self.closed:
            unknown = sorted(set(v) - set(self.fields))
            if unknown:
                name = _join(param, unknown[0])
                raise invalid(f"unknown field '{name}'", name, "unknown_field")
        out: dict[str, Any] = {}
        for key, node in self.fields.items():
            value = v.get(key)
            name = _join(param, key)
            if value is None:
                if key in self.required:
                    raise invalid(f"'{name}' is required", name, "missing_required_parameter")
                continue
            out[key] = node.check(value, name)
        return out

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "object",
                             "properties": {k: _nullable(n.schema(), k in self.required)
                                            for k, n in self.fields.items()}}
        if self.required:
            s["required"] = list(self.required)
        if self.closed:
            s["additionalProperties"] = False
        return self._described({**s, **self.extra})


def _join(param: str, key: str) -> str:
    return f"{param}.{key}" if param else key


def _nullable(s: dict[str, Any], required: bool) -> dict[str, Any]:
    """An optional field may also be null (treated as absent)."""
    if required:
        return s
    return {"anyOf": [s, {"type": "null"}]} if "anyOf" not in s else {
        **s, "anyOf": [*s["anyOf"], {"type": "null"}]}


@dataclass
class MapOf(Node):
    """A JSON object whose keys are whole numbers in [0, ``key_max``] (token ids, which
    JSON spells as strings) and whose values ``value`` checks; as ``(key, value)`` pairs."""

    value: Node
    key_max: int
    max_items: int
    doc: str = ""

    def check(self, v: Any, param: str) -> tuple[tuple[int, Any], ...]:
        if not isinstance(v, dict):
            raise invalid(f"'{param}' must be an object", param, "invalid_type")
        if len(v) > self.max_items:
            raise invalid(f"'{param}' may hold at most {self.max_items} entries", param,
                          "out_of_range")
        out = []
        for key, x in v.items():
            name = f"{param}.{key}"
            if not (key.isascii() and key.isdigit() and int(key) <= self.key_max):
                raise invalid(f"'{param}' keys must be token ids (0 to {self.key_max}), got "
                              f"{_got(key)}", param, "invalid_value")
            out.append((int(key), self.value.check(x, name)))
        return tuple(sorted(out))

    def schema(self) -> dict[str, Any]:
        return self._described({"type": "object", "maxProperties": self.max_items,
                                "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                                "additionalProperties": self.value.schema()})
