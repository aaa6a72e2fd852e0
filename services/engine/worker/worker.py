"""The engine's worker: one thread owns the EngineCore and steps it.

    event loop                              worker thread
    submit(command) ─► inbox ─────────────► _drain: apply each command (commands.py)
    _step_loop: wake ─► run_in_executor ──► _run_steps: step while there is work
    _publish ◄── call_soon_threadsafe ◄──── each step's events and status snapshot
    run(fn): a side job (status, abort, shrink) that a stepping run yields to

The event loop never runs model code, and every touch of the core (commands, steps,
status) runs on this one thread, in order. A step-loop task sleeps on an asyncio.Event
until work arrives, then hands the thread a stepping run: it steps back to back while
there is work and posts each step's outputs to the loop, which routes them to their
requests' streams (``OutputSink``) while the next step already runs. A run ends after the
step during which a side job was queued, so those wait at most one step.

Status never waits behind a forward pass: each step publishes a snapshot of the core's
counters with its outputs, and ``status(max_wait_s)`` answers from it when the thread
does not answer sooner (a busy engine is not a dead one).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from services.engine.api_types import EngineStatus
from services.engine.engine_core import EngineCore, Event, Failure
from services.engine.errors import INTERNAL, UNAVAILABLE, EngineError
from services.engine.worker.commands import Add, Command, apply

log = logging.getLogger(__name__)


class OutputSink(Protocol):
    """(event loop) Where each step's events go: the requests' streams."""

    def dispatch(self, events: list[Event]) -> None: ...


class Worker:
    def __init__(self, outputs: OutputSink) -> None:
        """Cheap: the thread starts with ``start``, stepping with ``serve``."""
        self._outputs = outputs
        self._executor: ThreadPoolExecutor | None = None
        self._core: EngineCore | None = None
        self._task: asyncio.Task | None = None
        self._inbox: deque[Command] = deque()  # appends and pops are atomic
        self._wake = asyncio.Event()
        self._side_jobs = 0  # jobs queued by the loop besides stepping runs (loop only)
        self._stopping = False
        self._pending_adds = 0  # Add commands not applied yet
        self._pending_tokens: deque[int] = deque()  # their prompt tokens to compute, in order
        self._waiting = 0  # the core's queue after the last step
        self._fresh: asyncio.Future[EngineStatus] | None = None  # a status question
        self.snapshot: EngineStatus | None = None  # the core's counters after the last step
        # (worker thread writes, the loop reads for liveness) monotonic start of the step
        # under way; 0: not stepping.
        self.step_started = 0.0

    # ---- lifecycle (event loop) ---------------------------------------------------------
    @property
    def running(self) -> bool:
        """The thread is up (``start`` .. ``shutdown``)."""
        return self._executor is not None

    @property
    def stepping(self) -> bool:
        """A core is served: its step loop runs."""
        return self._task is not None

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def start(self, threads: int) -> None:
        self._stopping = False
        if threads:
            torch.set_num_threads(threads)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        # OpenMP settings are per calling thread: give the worker the same intra-op team.
        await self.run(torch.set_num_threads, torch.get_num_threads())

    def abandon(self) -> None:
        """Start-up failed: let the thread go without waiting for it."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def serve(self, core: EngineCore) -> None:
        """Step ``core`` from now on (its snapshot is taken first)."""
        self._core = core
        self.snapshot = await self.run(core.status)
        self._task = asyncio.create_task(self._step_loop(), name="engine-step-loop")

    async def halt(self) -> None:
        """End stepping: the run under way ends after its current step."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def detach(self) -> None:
        """(after ``halt``, the core closed) Forget the core and what was queued for it:
        its queue, and the adds that never reached it (their streams were failed), so the
        next model's admission starts from an empty queue."""
        self._core = None
        self._inbox.clear()
        self._pending_adds = self._waiting = 0
        self._pending_tokens.clear()
        self.snapshot = None
        self._stopping = False

    def shutdown(self) -> None:
        self._stopping = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- jobs (event loop) --------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run ``fn(*args)`` on the worker thread (a side job: a stepping run yields to it
        after its current step)."""
        assert self._executor is not None, "the worker is not running"
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._side_jobs += 1
        fut.add_done_callback(self._side_job_done)
        return fut

    def _side_job_done(self, _: asyncio.Future) -> None:
        self._side_jobs -= 1

    def submit(self, command: Command, tokens: int = 0) -> None:
        """Queue ``command`` for the core; the next step applies it. ``tokens``: an Add's
        prompt tokens to compute (what admission prices it at until a step takes it in)."""
        if isinstance(command, Add):
            self._pending_adds += 1
            self._pending_tokens.append(tokens)
        self._inbox.append(command)
        self._wake.set()

    async def send(self, command: Command) -> None:
        """Queue ``command`` and apply the inbox now (without waiting for a step)."""
        self._inbox.append(command)
        await self.flush()

    async def flush(self) -> None:
        """Apply the queued commands now, as a side job (with a fresh snapshot: an
        abort on an idle engine frees a seat that admission must see)."""
        events, adds, status = await self.run(self._drain_and_status)
        self._publish(events, adds, status)

    def _drain_and_status(self) -> tuple[list[Event], int, EngineStatus]:
        """(worker thread) ``_drain``, then the core's status."""
        events, adds = self._drain()
        return events, adds, self._worker_core().status()

    @property
    def queued(self) -> int:
        """Requests in the core's queue after the last step, and those submitted since."""
        return self._waiting + self._pending_adds

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens of the requests submitted since the last step (not in
        ``snapshot`` yet): without them a burst that arrived within one step was forecast
        to wait for nothing, and its later requests waited seconds past the limit."""
        return sum(self._pending_tokens)

    def step_running_s(self) -> float:
        """How long the step under way has run (0.0: the worker is not stepping)."""
        started = self.step_started
        return time.monotonic() - started if started else 0.0

    async def status(self, max_wait_s: float | None = None) -> EngineStatus:
        """The core's counters after the queued commands; with ``max_wait_s``, when the
        thread is busy longer than that (a long forward pass), the last step's snapshot."""
        core = self._core
        assert core is not None, "no core is served"
        if max_wait_s is None:
            return await self._fresh_status(core)
        # One fresh question in flight at most: a wedged worker must not pile them up.
        if self._fresh is None or self._fresh.done():
            self._fresh = asyncio.ensure_future(self._fresh_status(core))
            self._fresh.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(self._fresh), max_wait_s)
        except TimeoutError:
            snapshot = self.snapshot  # (taken when serving began; None once detached)
            if snapshot is None:
                raise EngineError(UNAVAILABLE, "the engine stopped serving its model") from None
            return dataclasses.replace(snapshot, step_started=self.step_started)

    async def _fresh_status(self, core: EngineCore) -> EngineStatus:
        await self.flush()
        status: EngineStatus = await self.run(core.status)
        return status

    # ---- stepping -----------------------------------------------------------------------
    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            busy, retry_at = True, 0.0
            while busy:
                busy, retry_at = await loop.run_in_executor(self._executor, self._run_steps,
                                                            loop)
            if retry_at:  # waiting for the node's budget: try again then
                loop.call_at(loop.time() + max(0.0, retry_at - time.monotonic()),
                             self._wake.set)

    def _run_steps(self, loop: asyncio.AbstractEventLoop) -> tuple[bool, float]:
        """(worker thread) Step while there is work, posting each step's outputs to the
        loop; whether work is left when the run yields (a side job is queued, or the
        engine is stopping), and when to retry a wait for the node's budget (0: none)."""
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
                    assert self.snapshot is not None  # (taken when serving began)
                    status = self.snapshot
            try:
                loop.call_soon_threadsafe(self._publish, events, adds, status)
            except RuntimeError:  # the loop is closed: nobody is left to take outputs
                return False, 0.0
            if not busy or self._side_jobs or self._stopping:
                return busy, self._worker_core().budget_retry_at

    def _work(self) -> tuple[list[Event], int, EngineStatus, bool]:
        """(worker thread) One engine step after the inbox; the status after it."""
        self.step_started = time.monotonic()
        try:
            events, adds = self._drain()
            core = self._worker_core()
            events.extend(core.step())
            return events, adds, core.status(), core.has_work()
        finally:
            self.step_started = 0.0

    def _drain(self) -> tuple[list[Event], int]:
        """(worker thread) Apply the queued commands; their events and how many adds."""
        core = self._worker_core()
        events: list[Event] = []
        adds = 0
        while self._inbox:
            command = self._inbox.popleft()
            adds += isinstance(command, Add)
            if (event := apply(core, command)) is not None:
                events.append(event)
        return events, adds

    def _fail_all(self) -> tuple[list[Event], int]:
        """(worker thread) After a failed step: end every request with an internal error."""
        err = EngineError(INTERNAL, "the engine failed while running this request")
        _, adds = self._drain()
        return [Failure(o.request_id, err) for o in self._worker_core().abort_all()], adds

    def _worker_core(self) -> EngineCore:
        """The core, which exists whenever the worker runs a job of it."""
        assert self._core is not None
        return self._core

    # ---- publishing (event loop) --------------------------------------------------------
    def _publish(self, events: list[Event], adds_applied: int, status: EngineStatus) -> None:
        self._waiting = status.waiting
        self.snapshot = status  # (admission forecasts a newcomer's wait from its queue)
        self._dispatch(events, adds_applied)

    def _dispatch(self, events: list[Event], adds_applied: int) -> None:
        self._pending_adds = max(0, self._pending_adds - adds_applied)
        for _ in range(min(adds_applied, len(self._pending_tokens))):
            self._pending_tokens.popleft()
        self._outputs.dispatch(events)


def _retrieve(fut: asyncio.Future) -> None:
    """Take a background future's exception (one nobody awaited: a stopped engine)."""
    if not fut.cancelled():
        fut.exception()
