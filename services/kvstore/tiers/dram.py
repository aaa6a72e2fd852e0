"""DRAM tier: a bounded in-memory arena of chunk blobs (also the in-memory test tier).

The budget counts blob bytes. Blobs are kept as the very objects handed to ``put`` (no
copy); ``get`` returns the same object, so a decoded tensor views arena memory. Callers
must treat returned blobs as read-only except for sealing (see ``shared.chunk_codec``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.kvstore.tiers.base import Blob, Tier, TierStats
from services.kvstore.tiers.lru_index import IndexedTtl, PriorityLru


class DramTier(IndexedTtl, Tier):
    name = "dram"

    def __init__(self, capacity_bytes: int) -> None:
        self._index = PriorityLru(capacity_bytes)
        self._blobs: dict[str, Blob] = {}
        # What the store decoded each blob into (a chunk whose tensor views the blob): a
        # DRAM hit is then a lookup, not a header parse and a tensor construction.
        self._decoded: dict[str, Any] = {}

    async def get(self, key: str) -> Blob | None:
        return self.get_now(key)

    def get_now(self, key: str) -> Blob | None:
        """Synchronous ``get`` (no I/O): the store reads DRAM without awaiting."""
        blob = self._blobs.get(key)
        if blob is not None:
            self._index.touch(key, time.time())
        return blob

    def get_decoded(self, key: str, decode: Callable[[Blob], Any]) -> tuple[Blob, Any] | None:
        """``get_now`` and ``decode(blob)``, decoded once per stored blob (no I/O)."""
        blob = self._blobs.get(key)
        if blob is None:
            return None
        self._index.touch(key, time.time())
        obj = self._decoded.get(key)
        if obj is None:
            obj = self._decoded[key] = decode(blob)
        return blob, obj

    def peek(self, key: str) -> Blob | None:
        """The blob without refreshing its recency (no I/O, synchronous)."""
        return self._blobs.get(key)

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (a lookup hit) without reading it."""
        self._index.touch(key, time.time())

    def has_local(self, key: str) -> bool:
        return key in self._blobs

    async def put(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        return self.put_now(key, blob, priority)

    def put_now(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        """Synchronous ``put``: the store uses it so a put lands before any await."""
        size = len(blob)
        index = self._index
        old = self._blobs.get(key)
        if old is not None:
            self._decoded.pop(key, None)
            if index.bytes_used - len(old) + size <= index.capacity_bytes:
                self._blobs[key] = blob  # replaced in place (the index entry too)
                index.add(key, size, priority, time.time())
                return []
            self._drop(key)
        if index.bytes_used + size <= index.capacity_bytes:  # the common case: it fits
            evicted = []
        elif size > index.capacity_bytes:
            return [key]
        else:
            evicted = index.victims(size)
            for k in evicted:
                self._drop(k)
        self._blobs[key] = blob
        index.add(key, size, priority, time.time())
        return evicted

    def _drop(self, key: str) -> bool:
        self._index.remove(key)
        self._decoded.pop(key, None)
        return self._blobs.pop(key, None) is not None

    async def contains(self, key: str) -> bool:
        return key in self._blobs

    async def delete(self, key: str) -> bool:
        return self._drop(key)

    async def scan_expired(self, older_than: float) -> list[str]:
        return self._index.older_than(older_than)

    def stats(self) -> TierStats:
        return TierStats(
            self.name, len(self._blobs), self._index.bytes_used, self._index.capacity_bytes
        )

    def check_integrity(self) -> None:
        self._index.check_integrity()
        assert set(self._blobs) == set(self._index.keys()), "blobs and index disagree"
        assert set(self._decoded) <= set(self._blobs), "a decoded chunk outlived its blob"
        assert self._index.bytes_used <= self._index.capacity_bytes, "over budget"
