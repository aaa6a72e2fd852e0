"""Saves in flight per session, so a peer never serves half of a turn.

The scheduler may send a session's next turn to another node while this node is still
saving the previous one. That node then asks here (``FindPrefix`` with the previous
turn's length) and waits, bounded, until a save of at least that many tokens has landed
and none is running, instead of finding the history without its last turn. A staging for an
advisory asks the same of ``GetManifest`` with the turn's length as the scheduler knows
it (prompt + completion): ``turn_saved`` maps that onto what a save records.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from shared.session_key import SessionKey

SAVED_SESSIONS = 10_000  # sessions whose last saved length is remembered


class SaveWaits:
    """Event-loop only. ``saving(sid)`` brackets a save; ``saved(sid, tokens)`` records one
    that landed; ``wait(sid, tokens, timeout)`` returns once the session is settled."""

    def __init__(self) -> None:
        self._running: dict[SessionKey, int] = {}
        self._tokens: OrderedDict[SessionKey, int] = OrderedDict()
        self._block: dict[SessionKey, int] = {}  # the block size its saves were made in
        self._changed: dict[SessionKey, asyncio.Event] = {}
        self._waiters: dict[SessionKey, int] = {}

    @contextmanager
    def saving(self, sid: SessionKey) -> Iterator[None]:
        self._running[sid] = self._running.get(sid, 0) + 1
        try:
            yield
        finally:
            left = self._running[sid] - 1
            if left:
                self._running[sid] = left
            else:
                del self._running[sid]
            self._wake(sid)

    def saved(self, sid: SessionKey, tokens: int, block_size: int = 0) -> None:
        self._tokens[sid] = max(tokens, self._tokens.pop(sid, 0))
        if block_size > 0:
            self._block[sid] = block_size
        while len(self._tokens) > SAVED_SESSIONS:
            old, _ = self._tokens.popitem(last=False)
            self._block.pop(old, None)
        self._wake(sid)

    def running(self, sid: SessionKey) -> bool:
        """Whether a save of the session is under way."""
        return sid in self._running

    def forget(self, sid: SessionKey) -> None:
        self._tokens.pop(sid, None)
        self._block.pop(sid, None)

    def turn_saved(self, sid: SessionKey, turn_tokens: int) -> int:
        """What a save of a turn of ``turn_tokens`` (prompt + completion) records: its
        last token has no KV yet, and only whole blocks are saved."""
        computed = max(0, turn_tokens - 1)
        block = self._block.get(sid, 0)
        return computed // block * block if block else computed

    def settled(self, sid: SessionKey, tokens: int) -> bool:
        """No save of the session running, and one of ``tokens`` or more has landed."""
        return sid not in self._running and self._tokens.get(sid, 0) >= tokens

    async def wait(self, sid: SessionKey, tokens: int, timeout_s: float,
                   turn: bool = False) -> float:
        """Wait until ``settled(sid, tokens)`` or ``timeout_s``; the seconds waited. With
        ``turn``, ``tokens`` is a turn's length (``turn_saved``)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        self._waiters[sid] = self._waiters.get(sid, 0) + 1
        try:
            # (the block size becomes known with the session's first save: ask each time)
            while not self.settled(sid, self.turn_saved(sid, tokens) if turn else tokens):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                event = self._changed.setdefault(sid, asyncio.Event())
                try:
                    await asyncio.wait_for(event.wait(), left)
                except TimeoutError:
                    break
        finally:
            left_waiting = self._waiters[sid] - 1
            if left_waiting:
                self._waiters[sid] = left_waiting
            else:  # the last one: no event kept for a session nobody waits on
                del self._waiters[sid]
                self._changed.pop(sid, None)
        return time.monotonic() - t0

    def _wake(self, sid: SessionKey) -> None:
        event = self._changed.pop(sid, None)
        if event is not None:
            event.set()
