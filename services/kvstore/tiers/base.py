"""The tier interface: a bounded or unbounded map from key to chunk blob.

Every tier stores opaque blobs (encoded chunks or manifests) under string keys. The store
above it decides what a blob means; a tier only keeps, evicts and reports.

Contract common to all tiers:
- ``open`` acquires resources (files, clients, threads); constructors stay cheap.
  Raises ``TierOpenError`` with a message naming the config key and the fix.
- ``get`` returns the stored bytes or ``None`` (a miss). It does not check the chunk checksum;
  it raises ``ChunkCorrupt`` only when the medium itself reports corruption.
- ``put`` replaces any previous value and returns the keys it evicted to make room
  (possibly empty). A blob larger than the whole capacity is not stored and returns
  ``[key]`` (the new key itself counts as evicted).
- ``contains``/``delete`` never raise on a missing key.
- ``get/put/contains/delete/scan_expired`` raise ``TierUnavailable`` when the medium
  cannot be reached; the store turns that into a miss (get) or a retry (put).
- Methods are coroutines; blocking media run their I/O off the event loop. All methods
  are safe to call concurrently from one event loop.
- ``priority``: higher survives longer. Local tiers evict the lowest priority first, then
  the least recently used; remote tiers keep everything until ``scan_expired``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from shared.chunk_codec import ChunkCorrupt

Blob = bytes | bytearray
T = TypeVar("T")


class Stored:
    """One hit as a read's ``check`` sees it: a blob in memory, or (``FileStored``) a blob
    in a file, which a check can read straight to where its bytes are going (the pool load
    reads a chunk's payload into its pool blocks: one copy, no blob in between)."""

    key = ""  # the tier key the hit was read for ("" where the reader did not say)

    def __init__(self, blob: Blob) -> None:
        self._blob: Blob | None = blob
        self.nbytes = len(blob)

    @property
    def kept(self) -> Blob | None:
        """The whole blob if it is in memory (it was, or ``blob()`` read it), else None."""
        return self._blob

    def blob(self) -> Blob:
        """The whole blob in memory (a hit not in memory, a file's or a ranged S3 read's,
        reads it once through its own ``readinto``)."""
        if self._blob is None:
            buf = bytearray(self.nbytes)
            self.readinto(0, [memoryview(buf)])
            self._blob = buf
        return self._blob

    def read(self, offset: int, n: int) -> Blob | memoryview:
        """Up to ``n`` bytes from ``offset`` (fewer at the end)."""
        return memoryview(self.blob())[offset : offset + n]

    def readinto(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` in order with the bytes from ``offset``; ``ChunkCorrupt`` if the
        blob ends first."""
        src = memoryview(self.blob())
        for b in bufs:
            end = offset + len(b)
            if end > len(src):
                raise ChunkCorrupt(f"blob of {len(src)} bytes ends before byte {end}")
            b[:] = src[offset:end]
            offset = end


# One key of a checked batch read: a miss, or the hit with what the check made of it (or
# the ChunkCorrupt it raised).
Checked = tuple[Stored, "T | ChunkCorrupt"] | None


def apply_check(found: Stored | Blob | None, check: Callable[[Stored], T], key: str
                ) -> Checked[T]:
    """``(hit, check(hit))`` for the hit of tier key ``key``, the ``ChunkCorrupt`` the check
    raised in place of the result, or None for a miss."""
    if found is None:
        return None
    hit = found if isinstance(found, Stored) else Stored(found)
    hit.key = key
    try:
        return hit, check(hit)
    except ChunkCorrupt as e:
        return hit, e


def whole_blob(hit: Stored) -> Blob:
    """The trivial check: the blob itself (``get_many`` is this check on every hit)."""
    return hit.blob()


@dataclass(frozen=True)
class TierStats:
    name: str
    entries: int
    bytes_used: int
    capacity_bytes: int  # 0 = unbounded
    healthy: bool = True
    detail: str = ""


class Tier(ABC):
    """A storage tier (DRAM arena, RocksDB, S3). See the module docstring for the contract."""

    name: str = "tier"
    remote = False  # its reads wait on round trips (S3), not on this host's cores

    async def open(self) -> None:
        """Acquire resources. Default: nothing to acquire."""

    async def close(self) -> None:
        """Release resources; idempotent."""

    @abstractmethod
    async def get(self, key: str) -> Blob | None:
        """The blob stored under ``key`` or ``None``; refreshes its recency."""

    async def get_many(self, keys: list[str]) -> list[Blob | None]:
        """``get`` of each key, in order. Tiers whose I/O hops to a thread override it to
        pay that hop once per batch (a layer's chunks are read together)."""
        return [await self.get(k) for k in keys]

    async def get_many_checked(
        self, keys: list[str], check: Callable[[Stored], T]
    ) -> list[Checked[T]]:
        """``get_many``, then ``check`` (e.g. verify and decode) on every hit. Tiers that
        read on a worker thread override it to check there too, while the bytes they just
        read are still in the CPU's cache and off the event loop; file-backed tiers hand
        the check a ``FileStored``. Default: in-memory hits, on the loop."""
        return [apply_check(b, check, k)
                for k, b in zip(keys, await self.get_many(keys), strict=True)]

    @abstractmethod
    async def put(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        """Store ``blob``; return the keys evicted to make room."""

    @abstractmethod
    async def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (does not refresh recency)."""

    @abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    async def delete_copy(self, key: str, found: Stored) -> bool:
        """Remove ``key`` if it still holds the copy ``found`` was read from (a corrupt
        copy must not take a newer one written meanwhile with it). Tiers that cannot tell
        copies apart delete whatever is there."""
        return await self.delete(key)

    @abstractmethod
    async def scan_expired(self, older_than: float) -> list[str]:
        """Keys last written or read before the wall-clock time ``older_than``."""

    async def written_at(self, key: str) -> float | None:
        """Wall-clock time ``key``'s TTL counts from (its last write or refresh, or for an
        idle-expiring local tier its last use); None if absent. Default: the last use is
        unknown, so "now" for a present key."""
        return time.time() if await self.contains(key) else None

    async def refresh(self, key: str) -> bool:
        """Restart ``key``'s TTL clock (a manifest about to name it); False if absent.
        Default: nothing to restart."""
        return await self.contains(key)

    @abstractmethod
    def stats(self) -> TierStats:
        """A cheap snapshot of occupancy and health (no I/O)."""

    def has_local(self, key: str) -> bool:
        """Whether ``key`` is known present without I/O (local indexes). Default: False."""
        return False

    def pin(self, key: str) -> None:
        """Protect ``key`` from eviction and expiry until ``unpin`` (a prefix lease).

        Counted: n pins need n unpins; pinning an absent key is allowed. Default: nothing
        (remote tiers keep everything until their TTL; DRAM leases hold the blob itself).
        """

    def unpin(self, key: str) -> None:
        """Undo one ``pin``."""

    async def check_health(self) -> None:
        """Ask the medium whether it answers, if nothing has said so lately, so that
        ``stats().healthy`` turns false in an outage before a read or write fails (a
        remote tier). Never raises. Default: nothing to ask (local media)."""

    def check_integrity(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent. Default: nothing."""
