"""The requests in an engine, as the event loop sees them: a stream of outputs per request
id, the requests whose reuse plan is still being made, and the sessions they belong to.

    open(id) ──► queue          dispatch(events) puts each step's outputs (or a Failure's
    next_output(queue) ◄──        error) into its request's queue; next_output takes them,
                                  several coalesced into one when asked (a slow reader)
    planning(id)                the reuse planner is at work: an abort now is noted and
                                taken at its end (the request is not in the core yet)
    session(key)                a request of the session is here: an advisory for it comes
                                too late to prefetch anything

Event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from shared.session_key import SessionKey

from .api_types import GenerateOutput, merge_outputs
from .engine_core import Event, Failure
from .errors import INVALID_ARGUMENT, EngineError

OutputQueue = asyncio.Queue[GenerateOutput | EngineError]


class RequestStreams:
    def __init__(self) -> None:
        self._queues: dict[str, OutputQueue] = {}
        self._planning: set[str] = set()
        self._aborted_while_planning: set[str] = set()
        self._sessions: dict[SessionKey, int] = {}  # -> requests of it here now

    # ---- streams ------------------------------------------------------------------------
    def open(self, request_id: str) -> OutputQueue:
        """Claim ``request_id`` for a new stream (INVALID_ARGUMENT: it is running: a
        client's retry must not reach the core as a second sequence under one id)."""
        if request_id in self._queues:
            raise EngineError(INVALID_ARGUMENT, f"request id {request_id!r} is already running")
        queue: OutputQueue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str, queue: OutputQueue) -> None:
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]

    def is_open(self, request_id: str) -> bool:
        return request_id in self._queues

    def dispatch(self, events: list[Event]) -> None:
        """A step's events to their requests' queues (the worker's ``OutputSink``)."""
        for ev in events:
            queue = self._queues.get(ev.request_id)
            if queue is None:
                continue  # aborted by its client
            queue.put_nowait(ev.error if isinstance(ev, Failure) else ev)

    def fail_all(self, error: EngineError) -> None:
        """Every open stream ends with ``error`` (the engine stops serving)."""
        for queue in self._queues.values():
            queue.put_nowait(error)

    @staticmethod
    async def next_output(queue: OutputQueue, coalesce: bool = False) -> GenerateOutput:
        """The stream's next output (raises its error). ``coalesce``: outputs that queued up
        while the reader was busy come as one."""
        item = await queue.get()
        while coalesce and not isinstance(item, EngineError) and item.finish_reason is None \
                and not queue.empty():
            nxt = queue.get_nowait()
            item = nxt if isinstance(nxt, EngineError) else merge_outputs(item, nxt)
        if isinstance(item, EngineError):
            raise item
        return item

    # ---- requests being planned ---------------------------------------------------------
    @contextmanager
    def planning(self, request_id: str) -> Iterator[None]:
        self._planning.add(request_id)
        try:
            yield
        finally:
            self._planning.discard(request_id)

    def abort_planning(self, request_id: str) -> bool:
        """Note an abort of a request being planned (it ends when its planning does);
        whether it was."""
        if request_id not in self._planning:
            return False
        self._aborted_while_planning.add(request_id)
        return True

    def take_abort(self, request_id: str) -> bool:
        """Whether the request was aborted while it was planned (forgotten once asked)."""
        if request_id not in self._aborted_while_planning:
            return False
        self._aborted_while_planning.discard(request_id)
        return True

    # ---- sessions -----------------------------------------------------------------------
    @contextmanager
    def session(self, key: SessionKey) -> Iterator[None]:
        """A request of ``key`` is here for the duration."""
        self._sessions[key] = self._sessions.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._sessions.pop(key) - 1
            if left:
                self._sessions[key] = left

    def has_session(self, key: SessionKey) -> bool:
        return key in self._sessions
