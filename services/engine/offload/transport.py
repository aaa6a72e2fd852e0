"""How the worker side of the offload reaches the node's kvstore, and how its answers come
back, without the worker ever waiting on the network.

    worker thread                      event loop
    KVTransport.start_load(job) ─────► KVStoreClient: LoadIntoPool ─► job.readiness
    KVTransport.start_save(job) ─────► KVStoreClient: SaveFromPool
    KVTransport.release(lease)  ─────► KVStoreClient: ReleaseLease
                    worker inbox ◄──── KVStoreAnswers: a save answered, a load ended,
                                       the pool attached (each a typed command)

``LoopTransport`` is the real ``KVTransport``: each call only posts the job to the event
loop (``call_soon_threadsafe``). Tests give the offload a scripted one instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from services.engine.offload.jobs import LoadJob, SaveJob


class KVTransport(Protocol):
    """Thread-safe: each call only hands the job to the event loop."""

    def start_load(self, job: LoadJob) -> None: ...

    def start_save(self, job: SaveJob) -> None: ...

    def release(self, lease_id: str) -> None: ...


class KVStoreAnswers(Protocol):
    """(event loop) Where the kvstore's answers go: the engine turns each into a command
    for its worker (``worker/answers.py``)."""

    def save_answered(self, job_id: int, ok: bool) -> None:
        """Save ``job_id`` ended (``ok``: its chunks are stored): unpin its blocks."""
        ...

    def load_ended(self) -> None:
        """A load RPC ended: blocks parked behind a failed load may be free now."""
        ...

    def attached(self, blocks_per_chunk: int) -> None:
        """The pool is attached; the kvstore's chunks are this many blocks."""
        ...


class KVStoreCalls(Protocol):
    """(event loop) The calls a ``LoopTransport`` posts (``KVStoreClient``)."""

    def start_load(self, job: LoadJob, ended: Callable[[], None] | None = None) -> None: ...

    def start_save(self, job: SaveJob, done: Callable[[SaveJob, bool], None]) -> None: ...

    def release(self, lease_id: str) -> None: ...


class LoopTransport:
    """The worker's ``KVTransport``: each call is posted to the event loop, where the
    client runs it; what it answers goes to ``answers`` (on the loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: KVStoreCalls,
                 answers: KVStoreAnswers) -> None:
        self._loop = loop
        self._client = client
        self._answers = answers

    def _post(self, fn: Callable[..., None], *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the engine is going away
            return False
        return True

    def start_load(self, job: LoadJob) -> None:
        # When the RPC ends, wake the worker: blocks parked behind a failed load free up.
        if not self._post(self._client.start_load, job, self._answers.load_ended):
            job.readiness.fail(0, "the event loop is closed")
            job.readiness.finish()

    def start_save(self, job: SaveJob) -> None:
        self._post(self._client.start_save, job, self._saved)

    def _saved(self, job: SaveJob, ok: bool) -> None:
        self._answers.save_answered(job.job_id, ok)

    def release(self, lease_id: str) -> None:
        self._post(self._client.release, lease_id)
