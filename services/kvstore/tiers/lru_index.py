"""Bookkeeping for bounded local tiers: sizes, priorities, recency; eviction order.

Eviction order (Symphony §3.3): the lowest priority first, and within one priority the
least recently used first. Callers give later layers a lower priority, so the last layers
of the least recently used session go first.

    priority 0: [oldest ... newest]   <- evicted first, from the left
    priority 1: [oldest ... newest]
    ...
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    size: int
    priority: int
    touched: float  # wall-clock time of the last put or get


class PriorityLru:
    """Sizes and eviction order of the keys of one tier (no I/O, no locking: one loop)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self._entries: dict[str, Entry] = {}
        self._order: dict[int, OrderedDict[str, None]] = {}
        self._pins: dict[str, int] = {}  # leased keys: never victims, never expired

    def pin(self, key: str) -> None:
        """Keep ``key`` out of ``victims`` and ``older_than`` until as many ``unpin`` calls."""
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        n = self._pins.get(key, 0) - 1
        if n > 0:
            self._pins[key] = n
        else:
            self._pins.pop(key, None)

    def is_pinned(self, key: str) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def add(self, key: str, size: int, priority: int, now: float) -> None:
        """Record ``key`` (replacing any old entry) as the most recent of its priority."""
        old = self._entries.get(key)
        if old is not None:
            if old.priority == priority:  # a put over the same key: update it in place
                self.bytes_used += size - old.size
                old.size, old.touched = size, now
                self._order[priority].move_to_end(key)
                return
            self.remove(key)
        self._entries[key] = Entry(size, priority, now)
        bucket = self._order.get(priority)
        if bucket is None:
            bucket = self._order[priority] = OrderedDict()
        bucket[key] = None
        self.bytes_used += size

    def touch(self, key: str, now: float) -> None:
        e = self._entries.get(key)
        if e is not None:
            e.touched = now
            self._order[e.priority].move_to_end(key)

    def remove(self, key: str) -> Entry | None:
        e = self._entries.pop(key, None)
        if e is None:
            return None
        bucket = self._order[e.priority]
        del bucket[key]
        if not bucket:
            del self._order[e.priority]
        self.bytes_used -= e.size
        return e

    def victims(self, incoming: int) -> list[str]:
        """Keys to evict, in order, so that ``incoming`` more bytes fit (does not remove).

        Pinned keys are skipped, so the result may free less than needed (see ``fits``).
        """
        need = self.bytes_used + incoming - self.capacity_bytes
        out: list[str] = []
        if need <= 0:
            return out
        for prio in sorted(self._order):
            for key in self._order[prio]:
                if key in self._pins:
                    continue
                out.append(key)
                need -= self._entries[key].size
                if need <= 0:
                    return out
        return out

    def fits(self, incoming: int, victims: list[str], replacing: int = 0) -> bool:
        """Whether ``incoming`` bytes fit once ``victims`` (and ``replacing`` bytes) are gone."""
        freed = sum(self._entries[k].size for k in victims) + replacing
        return self.bytes_used - freed + incoming <= self.capacity_bytes

    def older_than(self, t: float) -> list[str]:
        return [k for k, e in self._entries.items() if e.touched < t and k not in self._pins]

    def keys(self) -> list[str]:
        return list(self._entries)

    def check_integrity(self) -> None:
        assert self.bytes_used == sum(e.size for e in self._entries.values()), "byte count drift"
        assert self.bytes_used >= 0
        assert all(n > 0 for n in self._pins.values()), "pin count not positive"
        ordered = [k for b in self._order.values() for k in b]
        assert len(ordered) == len(self._entries) == len(set(ordered)), "key in two buckets"
        for prio, bucket in self._order.items():
            assert bucket, "empty bucket kept"
            for k in bucket:
                assert self._entries[k].priority == prio, "key in the wrong priority bucket"


class IndexedTtl:
    """``Tier.written_at``/``refresh`` for a local tier whose ``PriorityLru`` is the truth:
    its TTL counts from the last use (``touched``), and a refresh is a use."""

    _index: PriorityLru

    def keys(self) -> list[str]:
        """Every key held (a snapshot)."""
        return self._index.keys()

    async def written_at(self, key: str) -> float | None:
        e = self._index.get(key)
        return None if e is None else e.touched

    async def refresh(self, key: str) -> bool:
        if key not in self._index:
            return False
        self._index.touch(key, time.time())
        return True
