"""Device prefetch loads under way, as the event loop sees them: a request whose prompt
starts where an advised session's load into the device is going waits for that load
(``join``) rather than load the same KV a second time.

    worker thread (DevicePrefetch)         event loop
    started(h) ── call_soon_threadsafe ──► loads[h] += 1          (h: the first block hash)
    settled(h) ── call_soon_threadsafe ──► loads[h] -= 1; at 0 the event of h is set
                                           join(h, timeout): await that event (bounded)

The worker only posts; the book is the loop's alone, so the loop never reads the worker's
state. ``settled`` comes after the loaded blocks are indexed: a request that joined finds
them when it peeks at the device cache next.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class PrefetchJoins:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loads: dict[bytes, int] = {}  # first block hash -> loads of it under way
        self._settled: dict[bytes, asyncio.Event] = {}

    # ---- the worker's side (a LoadWatch): thread-safe posts ---------------------------
    def started(self, first_hash: bytes) -> None:
        self._post(self._started, first_hash)

    def settled(self, first_hash: bytes) -> None:
        self._post(self._done, first_hash)

    def _post(self, fn: Callable[[bytes], None], first_hash: bytes) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(fn, first_hash)

    # ---- the event loop's side ----------------------------------------------------------
    def _started(self, first_hash: bytes) -> None:
        self._loads[first_hash] = self._loads.get(first_hash, 0) + 1
        self._settled.setdefault(first_hash, asyncio.Event())

    def _done(self, first_hash: bytes) -> None:
        left = self._loads.get(first_hash, 0) - 1
        if left > 0:
            self._loads[first_hash] = left
            return
        self._loads.pop(first_hash, None)
        event = self._settled.pop(first_hash, None)
        if event is not None:
            event.set()

    def loading(self, first_hash: bytes) -> bool:
        """Whether a load into the device of a prefix starting with this block is going."""
        return first_hash in self._loads

    async def join(self, first_hash: bytes, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the loads of this prefix to be settled; whether
        there was one and it was (False at once when none is under way)."""
        event = self._settled.get(first_hash)
        if event is None:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """The engine stops serving: loads under way will never be settled; release every
        request waiting for one."""
        for event in self._settled.values():
            event.set()
        self._settled.clear()
        self._loads.clear()
