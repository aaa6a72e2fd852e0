"""Ranged reads of one S3 object: its bytes in ``range_bytes`` pieces, fetched in parallel
straight to where they are going.

A chunk read for a load (``get_many_checked``) starts with one GET of the object's first
range, whose reply headers (``Content-Range``) name the object's size; its body is left
unread, a stream. The check (``CopyOnRead``) reads the chunk's head off it, then asks for
the payload into the request's pool blocks (``S3Stored.readinto``): the rest of the first
range comes off the stream while the ranges past it, started first, arrive as ranged GETs
run together on the ranges' own threads, each written into its part of the blocks::

    object    [ range 0 | range 1 | range 2 | range 3 ]
    GET 0     head ─► memory; rest ─► blocks (the stream, in order)
    GETs 1-3             ═══════ in parallel, each into its slice of the target blocks

So a chunk costs one round trip plus one of its ranges' (not one per range), an object
of one range is one GET, its payload is never assembled in a buffer of its own (nor
decoded, copied again or promoted to DRAM), and the check still verifies the chunk's MAC
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
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
        self.finish(key, self.submit(key, offset, bufs))

    def submit(self, key: str, offset: int, bufs: list[memoryview]) -> list[Future[None]]:
        """Start the ranged GETs filling ``bufs`` from ``offset`` (``finish`` waits)."""
        total = sum(len(b) for b in bufs)
        return [self.executor.submit(self._one, key, offset + lo, min(self.range_bytes,
                                                                       total - lo),
                                     cover(bufs, lo, min(self.range_bytes, total - lo)))
                for lo in range(0, total, self.range_bytes)]

    def finish(self, key: str, jobs: list[Future[None]]) -> None:
        """Wait for every one of ``jobs`` (they write into the caller's buffers), then
        raise the first failure as ``RangeFailed``."""
        wait(jobs)
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
    """An S3 object read by ranges (see the module doc). Its first range's reply is a
    stream: the bytes a check asks for in order come off it (a head into memory, a payload
    straight into the caller's buffers) while the ranges past it are fetched in parallel.
    ``kept`` stays None until ``blob()`` reads the whole: a chunk read straight into pool
    blocks is not promoted. ``release()`` ends the stream (the tier calls it once the check
    is done)."""

    def __init__(self, reads: RangedReads, obj_key: str, nbytes: int, stream: Any,
                 stream_len: int) -> None:
        self._blob = None
        self.nbytes = nbytes
        self._reads = reads
        self._obj = obj_key
        self._stream: Any = stream  # the first range's body, at byte _pos of the object
        self._stream_len = stream_len
        self._pos = 0
        self._head = bytearray()  # bytes 0 .. len(_head) - 1, kept (_pos >= len(_head))

    def release(self) -> None:
        """Close the first range's stream if it was not read to its end."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def read(self, offset: int, n: int) -> Blob | memoryview:
        n = max(0, min(n, self.nbytes - offset))
        if self._blob is not None:
            return memoryview(self._blob)[offset:offset + n]
        if (self._stream is not None and self._pos == len(self._head)
                and offset + n <= self._stream_len):
            self._keep(offset + n)  # a head: kept, for the reads that follow
        if offset + n <= len(self._head):
            return memoryview(self._head)[offset:offset + n]
        buf = bytearray(n)
        self.readinto(offset, [memoryview(buf)])
        return buf

    def readinto(self, offset: int, bufs: list[memoryview]) -> None:
        if self._blob is not None:
            return super().readinto(offset, bufs)
        want = sum(len(b) for b in bufs)
        end = offset + want
        if end > self.nbytes:
            raise ChunkCorrupt(f"s3: object of {self.nbytes} bytes ends before byte {end}")
        held = max(0, min(len(self._head), end) - offset)
        at = offset + held
        if self._stream is not None and self._pos < at <= self._stream_len:
            self._skip(at - self._pos)  # (a gap the caller does not want)
        streamed = (min(self._stream_len, end) - at
                    if self._stream is not None and self._pos == at else 0)
        ranged = want - held - streamed
        jobs = self._reads.submit(self._obj, at + streamed, cover(bufs, held + streamed,
                                                                   ranged)) if ranged else []
        try:
            if held:
                spread(memoryview(self._head)[offset:at], cover(bufs, 0, held))
            for d in cover(bufs, held, streamed) if streamed else ():
                d[:] = self._next(len(d))
        finally:
            self._reads.finish(self._obj, jobs)  # (every range ends before this returns)
        return None

    def _next(self, n: int) -> bytes:
        """The stream's next ``n`` bytes; ``RangeFailed`` if it ends first."""
        assert self._stream is not None
        data = self._stream.read(n)
        if len(data) != n:
            self.release()
            raise RangeFailed(key=self._obj, why=f"the first range ended {n - len(data)} "
                              "bytes early")
        self._pos += n
        if self._pos >= self._stream_len:
            self.release()
        return data

    def _keep(self, upto: int) -> None:
        self._head += self._next(upto - self._pos) if upto > self._pos else b""

    def _skip(self, n: int) -> None:
        if self._pos == len(self._head):
            self._head += self._next(n)  # (still a prefix: kept)
        else:
            self._next(n)
