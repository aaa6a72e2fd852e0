"""The AsyncEngine's worker thread: one thread owns the EngineCore and steps it.

    event loop                          worker thread
    _submit(kind, arg) ─► inbox ──────► _drain: add, abort, unpin, prefetch, end prefetch
    _step_loop: wake ─► run_in_executor ─► _run_steps: step while there is work
    _publish ◄── call_soon_threadsafe ◄── each step's outputs and status snapshot
    _in_worker(fn): a side job (status, abort, shrink) that a stepping run yields to

``WorkerLoop`` holds that half of ``AsyncEngine`` (async_engine.py), whose attributes
it uses as declared below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .admission import Admission
from .api_types import EngineStatus, GenerateOutput
from .engine_core import EngineCore, Event, Failure
from .errors import INTERNAL, EngineError

log = logging.getLogger(__name__)

ADD, ABORT, UNPIN = "add", "abort", "unpin"
PREFETCH, END_PREFETCH = "prefetch", "end_prefetch"


class WorkerLoop:
    _core: EngineCore | None
    _executor: ThreadPoolExecutor | None
    _inbox: deque[tuple[str, Any]]
    _wake: asyncio.Event
    _queues: dict[str, asyncio.Queue[GenerateOutput | EngineError]]
    _side_jobs: int
    _stopping: bool
    _snapshot: EngineStatus | None
    _step_started: float
    _admission: Admission
    _waiting_snapshot: int
    _pending_adds: int

    def _submit(self, kind: str, arg: Any) -> None:
        if kind == ADD:
            self._pending_adds += 1
        self._inbox.append((kind, arg))
        self._wake.set()

    def _in_worker(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        assert self._executor is not None
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._side_jobs += 1  # a running stepping run yields the worker after its step
        fut.add_done_callback(self._side_job_done)
        return fut

    def _side_job_done(self, _: asyncio.Future) -> None:
        self._side_jobs -= 1

    # ---- the worker side ----------------------------------------------------------------
    def _worker_core(self) -> EngineCore:
        """The core, which exists whenever the worker runs a job."""
        assert self._core is not None
        return self._core

    def _drain(self) -> tuple[list[Event], int]:
        """(worker thread) apply queued adds and aborts; the events and how many adds."""
        core = self._worker_core()
        events: list[Event] = []
        adds = 0
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == ADD:
                core.add(*arg)
                adds += 1
            elif kind == UNPIN:
                core.unpin(*arg)
            elif kind == PREFETCH:
                core.prefetch(arg)
            elif kind == END_PREFETCH:
                core.end_prefetch(*arg)
            elif (out := core.abort(arg)) is not None:
                events.append(out)
        return events, adds

    def _work(self) -> tuple[list[Event], int, EngineStatus, bool]:
        """(worker thread) one engine step after the inbox; the status after it."""
        self._step_started = time.monotonic()
        try:
            events, adds = self._drain()
            core = self._worker_core()
            events.extend(core.step())
            return events, adds, core.status(), core.has_work()
        finally:
            self._step_started = 0.0

    async def _run_inbox(self) -> None:
        events, adds = await self._in_worker(self._drain)
        self._dispatch(events, adds)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            busy = True
            while busy:
                busy = await loop.run_in_executor(self._executor, self._run_steps, loop)
            core = self._core
            if core is not None and core.budget_retry_at:  # waiting for the node's budget
                loop.call_at(loop.time() + max(0.0, core.budget_retry_at - time.monotonic()),
                             self._wake.set)

    def _run_steps(self, loop: asyncio.AbstractEventLoop) -> bool:
        """(worker thread) step while there is work, posting each step's outputs to the
        loop; whether work is left when the run yields (another worker job is queued, or
        the engine is stopping)."""
        while True:
            try:
                events, adds, status, busy = self._work()
            except Exception:
                log.exception("engine step failed; failing every active request")
                (events, adds), busy = self._fail_all(), False
                try:
                    status = self._worker_core().status()
                except Exception:  # keep the step loop alive whatever the core's state
                    log.exception("engine status failed after a failed step")
                    assert self._snapshot is not None  # (taken at start)
                    status = self._snapshot
            try:
                loop.call_soon_threadsafe(self._publish, events, adds, status)
            except RuntimeError:  # the loop is closed: nobody is left to take outputs
                return False
            if not busy or self._side_jobs or self._stopping:
                return busy

    def _publish(self, events: list[Event], adds_applied: int, status: EngineStatus) -> None:
        self._waiting_snapshot = status.waiting
        self._snapshot = status
        self._admission.observe(time.monotonic(), status.admitted, status.waiting)
        self._dispatch(events, adds_applied)

    def _fail_all(self) -> tuple[list[Event], int]:
        """(worker thread) after a failed step: end every request with an internal error."""
        err = EngineError(INTERNAL, "the engine failed while running this request")
        _, adds = self._drain()
        return [Failure(o.request_id, err) for o in self._worker_core().abort_all()], adds

    def _dispatch(self, events: list[Event], adds_applied: int) -> None:
        self._pending_adds = max(0, self._pending_adds - adds_applied)
        for ev in events:
            queue = self._queues.get(ev.request_id)
            if queue is None:
                continue  # aborted by its client
            if isinstance(ev, Failure):
                queue.put_nowait(ev.error)
            else:
                queue.put_nowait(ev)
