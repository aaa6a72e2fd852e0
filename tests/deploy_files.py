"""Reading the deployment files as Docker Compose would (for the tests: no Docker engine
here): ``compose.yaml`` with its YAML merge keys and ``${VAR:-default}`` interpolation."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
SERVICES = ("scheduler", "nodemgr", "engine", "kvstore")
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str] | None = None) -> Any:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` in every string of ``value``."""
    env = os.environ if env is None else env
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml, merged and interpolated (with ``env``, else none: the defaults)."""
    data = yaml.safe_load(COMPOSE.read_text())
    return interpolate(data, env if env is not None else {})


def overture_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the Overture image."""
    return {name: s for name, s in doc["services"].items()
            if "build" in s or "overture" in str(s.get("image", ""))}


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}
