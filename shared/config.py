"""Typed, layered configuration: dataclass defaults < YAML file < environment < flags.

Every service owns one frozen dataclass tree. Fields carry their documentation and valid
range in ``field(metadata=...)`` so that ``--help`` lists every option with its default and
validation errors name the offending key (``engine.block_size``) and the fix.

Environment variables follow one rule: ``OVERTURE_<SECTION>__<KEY>`` where nested keys are
joined with ``__`` too, e.g. ``OVERTURE_KVSTORE__S3__BUCKET=kv``.

Flags are the dotted key path below the section: ``--block-size 16``, ``--s3.bucket kv``.

A key that moved keeps working for one release: a config class lists it in
``DEPRECATED_KEYS`` (old key -> new dotted key); YAML, environment and flags may still use
the old name, which is moved to the new one with a warning that names both.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
log = logging.getLogger(__name__)

ENV_PREFIX = "OVERTURE_"


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range; the message names the key."""


def opt(
    default: Any,
    doc: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: Sequence[Any] | None = None,
) -> Any:
    """Declare a config field with a one-line doc and an optional validated range."""
    meta = {"doc": doc, "min": min, "max": max, "choices": tuple(choices) if choices else None}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def sub(cls: type, doc: str = "") -> Any:
    """Declare a nested config section."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "section": True})


# ---------------------------------------------------------------------------------------
# type coercion


def _resolve_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Turn a YAML/env/flag value into the field's declared type or raise ConfigError."""
    base, optional = _strip_optional(tp)
    empty = isinstance(value, str) and value.lower() in ("", "none", "null")
    if value is None or (optional and empty):
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required (got null)")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, str):
                return int(parse_size(value))
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if base is str:
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
        origin = typing.get_origin(base)
        if origin in (list, tuple):
            (item_tp, *_rest) = typing.get_args(base) or (str,)
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            items = [_coerce(f"{key}[{i}]", item_tp, v) for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
        if origin is dict:
            if isinstance(value, str):  # (from the environment or a flag) k=v,k2=v2
                pairs = [p.rpartition("=") for p in value.split(",") if p.strip()]
                if not all(k and sep for k, sep, _ in pairs):
                    raise ValueError(value)
                value = {k.strip(): v.strip() for k, _, v in pairs}
            if not isinstance(value, Mapping):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{key}: expected {getattr(base, '__name__', base)}, got {value!r}"
        ) from None
    return value


_SIZE_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Accept plain ints and byte sizes like ``512MiB``, ``2G``, ``64k``."""
    t = text.strip().lower().replace("_", "")
    for suffix in ("ib", "b"):
        if t.endswith(suffix) and len(t) > len(suffix) and t[-len(suffix) - 1] in _SIZE_SUFFIX:
            t = t[: -len(suffix)]
            break
    if t and t[-1] in _SIZE_SUFFIX:
        return int(float(t[:-1]) * _SIZE_SUFFIX[t[-1]])
    return int(t)


# ---------------------------------------------------------------------------------------
# building


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(cls))


def _is_section(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("section"))


def _check_range(key: str, f: dataclasses.Field[Any], value: Any) -> None:
    meta = f.metadata
    if value is None:
        return
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if lo is not None and value < lo:
            raise ConfigError(f"{key}: {value!r} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise ConfigError(f"{key}: {value!r} is above the maximum {hi}")


def _deprecated_keys(cls: type) -> Mapping[str, str]:
    return getattr(cls, "DEPRECATED_KEYS", {})


def _move_deprecated(values: dict[str, Any], renames: Mapping[str, str], prefix: str
                     ) -> dict[str, Any]:
    """``values`` with each deprecated key moved to its new place (a value given under the
    new key wins), warning once per key found."""
    for old, new in renames.items():
        if old not in values:
            continue
        value = values.pop(old)
        log.warning("config key %s%s is deprecated and will be removed in the next release; "
                    "use %s%s instead", prefix, old, prefix, new)
        *parents, leaf = new.split(".")
        node = values
        for part in parents:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, Mapping) else {}
            node = node[part]
        node.setdefault(leaf, value)
    return values


def build(cls: type[T], values: Mapping[str, Any], prefix: str = "") -> T:
    """Build a frozen config of ``cls`` from a nested mapping, validating every key."""
    values = _move_deprecated(dict(values or {}), _deprecated_keys(cls), prefix)
    hints = _resolve_types(cls)
    known = {f.name for f in _fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key in {where}; known keys: {', '.join(sorted(known))}"
        )
    kwargs: dict[str, Any] = {}
    for f in _fields(cls):
        key = f"{prefix}{f.name}"
        if _is_section(f):
            sub_values = values.get(f.name) or {}
            if not isinstance(sub_values, Mapping):
                raise ConfigError(f"{key}: expected a mapping, got {sub_values!r}")
            kwargs[f.name] = build(hints[f.name], sub_values, prefix=f"{key}.")
        elif f.name in values:
            v = _coerce(key, hints[f.name], values[f.name])
            _check_range(key, f, v)
            kwargs[f.name] = v
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def _set_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: conflicts with a scalar at {part}")
    node[path[-1]] = value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a whole-cluster YAML file (one mapping per section)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"config file {p}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: the top level must be a mapping of sections")
    return data


def env_values(section: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Collect ``OVERTURE_<SECTION>__<KEY>[__<SUBKEY>]`` variables into a nested mapping."""
    head = f"{ENV_PREFIX}{section.upper()}__"
    tree: dict[str, Any] = {}
    for name, value in env.items():
        if name.startswith(head):
            path = [p.lower() for p in name[len(head):].split("__") if p]
            if path:
                _set_path(tree, path, value)
    return tree


def _flag_specs(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted key, field, default) for every leaf field of ``cls``."""
    out = []
    default_obj = cls()
    for f in _fields(cls):
        if _is_section(f):
            sub_cls = type(getattr(default_obj, f.name))
            out.extend(_flag_specs(sub_cls, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f, getattr(default_obj, f.name)))
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` per leaf field; help shows its doc and default."""
    group = parser.add_argument_group(f"{cls.__name__} options")
    for key, f, default in _flag_specs(cls):
        flag = "--" + key.replace("_", "-")
        extra = ""
        if f.metadata.get("choices"):
            extra = f" (one of: {', '.join(map(str, f.metadata['choices']))})"
        group.add_argument(
            flag,
            dest=f"cfg::{key}",
            default=argparse.SUPPRESS,
            metavar=key.split(".")[-1].upper(),
            # (argparse formats help with %: a doc's "50-100%" must reach it as "%%")
            help=f"{f.metadata.get('doc', '')}{extra} [default: {default!r}]".replace("%", "%%"),
        )
    for old in _deprecated_keys(cls):  # still accepted, not advertised
        group.add_argument("--" + old.replace("_", "-"), dest=f"cfg::{old}",
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in vars(ns).items():
        if name.startswith("cfg::"):
            _set_path(tree, name[len("cfg::"):].split("."), value)
    return tree


def load(
    cls: type[T],
    section: str,
    *,
    yaml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Layer defaults < YAML section < environment < flags < overrides and build ``cls``."""
    values: dict[str, Any] = {}
    if yaml_path is not None:
        data = load_yaml(yaml_path)
        sect = data.get(section) or {}
        if not isinstance(sect, Mapping):
            raise ConfigError(f"{section}: expected a mapping in {yaml_path}")
        values = _deep_merge(values, sect)
    values = _deep_merge(values, env_values(section, env if env is not None else {}))
    values = _deep_merge(values, flags or {})
    values = _deep_merge(values, overrides or {})
    return build(cls, values, prefix=f"{section}.")


def parse_service_args(
    cls: type[T], section: str, argv: Sequence[str] | None, description: str
) -> T:
    """Parse ``argv`` for one service: ``--config FILE`` plus one flag per option."""
    parser = argparse.ArgumentParser(prog=f"overture {section}", description=description)
    parser.add_argument("--config", default=None, help="YAML file with a section per service")
    add_arguments(parser, cls)
    ns = parser.parse_args(argv)
    try:
        return load(cls, section, yaml_path=ns.config, env=os.environ, flags=flag_values(ns))
    except ConfigError as e:
        parser.error(str(e))
        raise  # unreachable; parser.error exits


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested mapping of a config (for passing to child processes as YAML)."""
    return dataclasses.asdict(cfg)
