"""Ranged reads of one S3 object: its bytes in ``range_bytes`` pieces, fetched in parallel
straight to where they are going.

A chunk read for a load (``get_many_checked``) starts with one GET of the object's first
range, whose ``Content-Range`` names the object's size; the check (``CopyOnRead``) then
asks for the rest into the request's pool blocks (``S3Stored.readinto``), and those bytes
come as ranged GETs run together on the ranges' own threads, each written into its part
of the blocks as it lands::

    object   [ range 0 | range 1 | range 2 | range 3 ]
    GET 0    ─────────┘  (size known; the check places the head)
    GETs 1-3            ═══════ in parallel, each into its slice of the target blocks

So a chunk costs one round trip plus one of its ranges' (not one per range), its payload
is never assembled in a buffer of its own, and the check still verifies the chunk's MAC
over every byte (``verify_parts`` over the blocks): a forged or corrupt range fails the
chunk like a corrupt object. A range that fails to arrive (an error, a short body) fails
the whole read with ``RangeFailed`` after every range of it has ended (nothing writes into
the blocks once the read has returned): the tier retries it or the load's layer falls
back to recompute; the object itself is not condemned.

Bounded: the ranges of every read share one executor of ``threads`` workers, separate from
the tier's (a read waiting for its ranges holds one of the tier's threads, never one of
the ranges', so the two cannot starve each other).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from botocore.exceptions import BotoCoreError

from services.kvstore.tiers.base import Blob, Stored
from shared.chunk_codec import ChunkCorrupt


class RangeFailed(BotoCoreError):
    """A range of an object did not arrive whole (retryable, like a connection error)."""

    fmt = "s3 ranged read of {key} failed: {why}"


def content_size(resp: dict[str, Any], got: int) -> int:
    """The object's size from a ranged GET's reply (``bytes 0-9/1234``); ``got`` when the
    endpoint ignored the range and sent the whole object."""
    cr = str(resp.get("ContentRange") or "")
    if "/" not in cr:
        return got
    total = cr.rsplit("/", 1)[1]
    if not total.isdigit():
        raise RangeFailed(key="?", why=f"unusable Content-Range {cr!r}")
    return int(total)


def cover(bufs: list[memoryview], start: int, n: int) -> list[memoryview]:
    """The slices of ``bufs`` (taken end to end) holding bytes ``start .. start + n``."""
    out = []
    pos = 0
    for b in bufs:
        end = pos + len(b)
        if end > start and pos < start + n:
            lo = max(start, pos) - pos
            hi = min(start + n, end) - pos
            out.append(b[lo:hi])
        pos = end
        if pos >= start + n:
            break
    return out


def spread(src: Blob | memoryview, dst: list[memoryview]) -> None:
    """Copy ``src`` end to end into ``dst`` (their lengths add up to its length)."""
    view = memoryview(src)
    pos = 0
    for d in dst:
        d[:] = view[pos:pos + len(d)]
        pos += len(d)


class RangedReads:
    """Ranged GETs of objects, in parallel on a bounded executor. ``get_range(key, lo,
    hi)`` is the blocking GET of bytes ``lo .. hi - 1`` (inclusive end is its business)."""

    def __init__(self, get_range: Callable[[str, int, int], bytes], range_bytes: int,
                 executor: ThreadPoolExecutor, stop: threading.Event) -> None:
        self.get_range = get_range
        self.range_bytes = range_bytes
        self.executor = executor
        self.stop = stop

    def into(self, key: str, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` (end to end) with the object's bytes from ``offset``: one ranged
        GET per ``range_bytes``, all at once; returns once every one has ended."""
        total = sum(len(b) for b in bufs)
        jobs = []
        for lo in range(0, total, self.range_bytes):
            n = min(self.range_bytes, total - lo)
            jobs.append(self.executor.submit(self._one, key, offset + lo, n,
                                             cover(bufs, lo, n)))
        wait(jobs)  # every range ends before this returns (they write into bufs)
        for j in jobs:
            err = j.exception()
            if err is not None:
                if isinstance(err, BotoCoreError):
                    raise err
                raise RangeFailed(key=key, why=repr(err)) from err

    def _one(self, key: str, lo: int, n: int, dst: list[memoryview]) -> None:
        if self.stop.is_set():
            raise RangeFailed(key=key, why="the tier is closing")
        data = self.get_range(key, lo, lo + n)
        if len(data) != n:
            raise RangeFailed(key=key, why=f"bytes {lo}+{n}: {len(data)} arrived")
        spread(data, dst)


class S3Stored(Stored):
    """An S3 object read by ranges (see the module doc): its first range in memory, the
    rest fetched on demand into the caller's buffers. ``kept`` stays None until
    ``blob()`` reads the whole: a chunk read straight into pool blocks is not promoted."""

    def __init__(self, reads: RangedReads, obj_key: str, nbytes: int, first: bytes) -> None:
        self._blob = None
        self.nbytes = nbytes
        self._reads = reads
        self._obj = obj_key
        self._first = first  # bytes 0 .. len(first) - 1

    def blob(self) -> Blob:
        if self._blob is None:
            buf = bytearray(self.nbytes)
            self.readinto(0, [memoryview(buf)])
            self._blob = buf
        return self._blob

    def read(self, offset: int, n: int) -> Blob | memoryview:
        n = max(0, min(n, self.nbytes - offset))
        if self._blob is not None or offset + n <= len(self._first):
            src = self._blob if self._blob is not None else self._first
            return memoryview(src)[offset:offset + n]
        buf = bytearray(n)
        self.readinto(offset, [memoryview(buf)])
        return buf

    def readinto(self, offset: int, bufs: list[memoryview]) -> None:
        if self._blob is not None:
            return super().readinto(offset, bufs)
        want = sum(len(b) for b in bufs)
        if offset + want > self.nbytes:
            raise ChunkCorrupt(f"s3: object of {self.nbytes} bytes ends before byte "
                               f"{offset + want}")
        held = max(0, min(len(self._first) - offset, want))
        if held:
            spread(memoryview(self._first)[offset:offset + held], cover(bufs, 0, held))
        if want > held:
            self._reads.into(self._obj, offset + held, cover(bufs, held, want - held))
        return None
