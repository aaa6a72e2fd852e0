"""A process's own CPU cores: parse a core list ("0-3,6") and pin every thread to it.

Several engines on one host each running a full team of OpenMP threads fight over the
same cores (and libgomp stops spinning once its team outnumbers the cores), so each
node's processes get their own share: ``engine.cpus`` / ``kvstore.cpus``, which
``overture up --nodes N`` fills in by dividing the host's cores among the nodes.
"""

from __future__ import annotations

import logging
import os

from shared.config import ConfigError

log = logging.getLogger(__name__)


class CpuListError(ConfigError):
    """A core list that does not parse, or names cores this process may not use."""


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``; empty -> ``()`` (no pinning)."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise CpuListError(f"bad core list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise CpuListError(f"bad core list {text!r}: {part!r} is not an ascending range")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cpus(cores: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(c) for c in cores)


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def divide_cpus(cores: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """Split ``cores`` into ``parts`` contiguous shares, as equal as possible (the first
    shares take the remainder). With fewer cores than parts, parts share cores round-robin:
    each still gets one core of its own to spin on rather than all of them."""
    if parts <= 0 or not cores:
        return [() for _ in range(max(parts, 0))]
    if parts > len(cores):
        return [(cores[i % len(cores)],) for i in range(parts)]
    size, extra = divmod(len(cores), parts)
    shares, start = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        shares.append(cores[start:start + n])
        start += n
    return shares


def pin_process(text: str) -> tuple[int, ...]:
    """Pin every thread of this process to the cores of ``text`` (threads started later
    inherit it); returns the cores, ``()`` when ``text`` is empty (nothing changes)."""
    cores = parse_cpus(text)
    if not cores:
        return ()
    allowed = set(available_cpus())
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise CpuListError(
            f"cores {format_cpus(missing)} of {text!r} are not available to this process "
            f"(it may use {format_cpus(sorted(allowed))})"
        )
    pinned: set[str] = set()
    while todo := set(os.listdir("/proc/self/task")) - pinned:  # (until no thread is new)
        for tid in todo:
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        pinned |= todo
    log.info("pinned to cores %s", format_cpus(cores))
    return cores
