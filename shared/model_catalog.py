"""The models a cluster may serve: the ``models:`` list of the cluster's YAML file.

    models:
      - {name: chat-small, path: /models/small, ttft_slo_s: 1.0, tpot_slo_s: 0.1}
      - {name: coder, path: /models/coder, ttft_slo_s: 2.0, pin: true}
      - {name: batch, path: /models/batch, priority: -1}

A model in the catalogue need not be running anywhere: a node activates it into one of its
standby engines when a request for it arrives (Prism §5.2, §6.2) and evicts it again when it
has been idle and the memory is wanted, models with looser SLOs first. ``pin: true`` keeps
a model from being evicted. ``priority`` (an integer, default 0, higher = more important)
orders the models of a node that lend their layers' weight memory to KV under pressure
(MIRAGE §5.2): idle models first, then active ones lowest priority first (at equal priority
the looser TTFT SLO first); a pinned model lends last. The scheduler and every nodemgr
read the same file (``models_config``; ``overture up`` writes one for its ``--model``
flags).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.config import ConfigError, load_yaml

DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_TPOT_SLO_S = 0.2


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    pin: bool = False
    priority: int = 0  # higher = more important: lends its weight memory to KV later

    def weight_bytes(self) -> int:
        """Bytes of its weight files (what activating it reads)."""
        return sum(f.stat().st_size for f in Path(self.path).glob("*.safetensors"))


def weight_bytes_of(entries: Iterable[ModelEntry]) -> Callable[[str], int]:
    """A model's weight bytes by name, as its entry's files say (0: not in ``entries``, or
    its files are not readable here)."""
    by_name = {m.name: m for m in entries}

    def size(model: str) -> int:
        entry = by_name.get(model)
        try:
            return entry.weight_bytes() if entry is not None else 0
        except OSError:
            return 0

    return size


def load_catalog(path: str | Path | None) -> tuple[ModelEntry, ...]:
    """The ``models:`` list of the YAML file at ``path`` (none: empty). ConfigError names
    the entry and field that is wrong."""
    if not path:
        return ()
    raw = load_yaml(path).get("models") or []
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: models: must be a list of model entries")
    out: list[ModelEntry] = []
    for i, item in enumerate(raw):
        out.append(_entry(item, f"{path}: models[{i}]"))
    names = [m.name for m in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{path}: models: {sorted(dup)[0]!r} is listed twice")
    return tuple(out)


def _entry(item: Any, where: str) -> ModelEntry:
    if not isinstance(item, dict):
        raise ConfigError(f"{where} must be a mapping with name and path")
    unknown = set(item) - {"name", "path", "ttft_slo_s", "tpot_slo_s", "pin", "priority"}
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    for key in ("name", "path"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    slos = {}
    for key, default in (("ttft_slo_s", DEFAULT_TTFT_SLO_S), ("tpot_slo_s", DEFAULT_TPOT_SLO_S)):
        v = item.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v <= 0:
            raise ConfigError(f"{where}: {key} must be a positive number of seconds")
        slos[key] = float(v)
    pin = item.get("pin", False)
    if not isinstance(pin, bool):
        raise ConfigError(f"{where}: pin must be true or false")
    priority = item.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}: priority must be an integer (higher = lends its "
                          "weight memory to KV later; default 0)")
    return ModelEntry(item["name"], item["path"], pin=pin, priority=priority, **slos)


def write_catalog(path: str | Path, entries: list[ModelEntry]) -> Path:
    p = Path(path)
    p.write_text(yaml.safe_dump({"models": [asdict(e) for e in entries]}, sort_keys=False))
    return p
