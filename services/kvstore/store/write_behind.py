"""Write-behind: copies DRAM-resident blobs down to SSD and the lowest tier, in order.

One job per blob; its targets are written in order (SSD before S3), so by the time a
chunk is acknowledged durable in the lowest tier it is also on SSD (unless SSD failed).

    submit ──► pending (bounded) ──► worker: seal, put target 0, target 1 ... ──► ack
                  ▲                            │ TierUnavailable on the durable target
                  └──── not_before = now + backoff (doubling, capped) ◄┘

Workers take the oldest ready job, except that every other pick (every pick while the
lowest tier is unhealthy) prefers the oldest with a local target (SSD) still to write. A
full queue drops the job with the lowest priority, oldest first (possibly the new one);
its ack fails with ``WriteDropped``. While the lowest tier is unhealthy, jobs with a local
write still to do are dropped last. So an unreachable lowest tier, whose retries would
otherwise fill the queue and every worker, never keeps a chunk from reaching the SSD (a
drop loses a lowest-tier write, which a later save or manifest makes again), and once it
is back its retries are served, not starved by new work. A local (non-durable) target
that keeps failing is skipped after ``LOCAL_ATTEMPTS`` tries.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import operator
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.kvstore.errors import TierUnavailable, WriteDropped, WriteRefused
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store.checksum_work import checksum_work
from services.kvstore.tiers.base import Blob, Tier
from shared.chunk_codec import is_sealed, seal_chunk

log = logging.getLogger(__name__)

LOCAL_ATTEMPTS = 3
RECENT_DROPS_S = 300.0  # how long a drop is reported in the store's health detail
RECENT_DROPS_KEPT = 10_000
PutFn = Callable[[Tier, str, Blob, int], Awaitable[object]]
UndoFn = Callable[[Tier, str], Awaitable[object]]


@dataclass
class WriteJob:
    key: str
    blob: Blob
    priority: int
    targets: list[Tier]
    durable: bool  # the last target is the lowest tier; success = durability
    done: asyncio.Future[None]
    seq: int
    is_chunk: bool = True
    next_target: int = 0
    local_left: bool = True  # a target above the lowest tier is still to be written
    forgotten: bool = False  # its key was deleted while it ran: write no more, undo
    attempts: int = 0
    not_before: float = field(default=0.0)


class WriteBehind:
    def __init__(
        self,
        put: PutFn,
        metrics: KVStoreMetrics,
        bound: int,
        workers: int,
        backoff_s: float = 0.05,
        backoff_max_s: float = 5.0,
        undo: UndoFn | None = None,
    ) -> None:
        self._put = put
        self._undo = undo
        self._metrics = metrics
        self.bound = bound
        self._workers_n = workers
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._pending: list[WriteJob] = []
        self._active = 0
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # set whenever nothing is queued or active
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = itertools.count()
        self.dropped = 0
        self._drop_times: deque[float] = deque(maxlen=RECENT_DROPS_KEPT)
        self._picks = 0
        # Unfinished jobs per key, oldest first: only the oldest may run, so a key's writes
        # land in the order they were submitted (a retried older write never lands last).
        self._by_key: dict[str, deque[WriteJob]] = {}

    @property
    def depth(self) -> int:
        """Jobs queued or being written."""
        return len(self._pending) + self._active

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"kv-write-{i}")
            for i in range(self._workers_n)
        ]

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or being written (True), or ``timeout`` passes."""
        if self._idle is None or not self.depth:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, drain_s: float) -> None:
        """Wait up to ``drain_s`` for the queue to empty, then cancel the workers."""
        if self.depth and self._idle is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_s)
            except TimeoutError:
                log.warning("shutting down with %d write-behind jobs unfinished", self.depth)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for job in self._pending:
            _fail(job, WriteDropped(f"{job.key}: kvstore shut down before the write completed"))
        self._pending.clear()
        self._by_key.clear()
        self._metrics.queue_depth.set(0)

    def submit(
        self,
        key: str,
        blob: Blob,
        priority: int,
        targets: list[Tier],
        durable: bool,
        is_chunk: bool = True,
    ) -> asyncio.Future[None]:
        """Queue ``blob`` for ``targets`` (in order); the future resolves when all are written."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not targets:
            fut.set_result(None)  # nothing to consume: it can never hold an exception
            return fut
        fut.add_done_callback(_consume)
        job = WriteJob(key, blob, priority, list(targets), durable, fut, next(self._seq), is_chunk)
        job.local_left = _local_left(job)
        self._pending.append(job)
        self._by_key.setdefault(key, deque()).append(job)
        self._drop_if_full()
        self._metrics.queue_depth.set(self.depth)
        if self._idle is not None:
            self._idle.clear()
        self._wake()
        return fut

    def forget(self, key: str) -> int:
        """Drop the queued (not yet started) jobs of ``key``: it was deleted, and a write
        landing afterwards would bring it back. Their acks fail with ``WriteDropped``."""
        gone = [j for j in self._pending if j.key == key]
        for job in gone:
            self._pending.remove(job)
            self._retire(job)
            _fail(job, WriteDropped(f"{job.key}: deleted before it was written"))
        for job in self._by_key.get(key, ()):
            job.forgotten = True  # under way: it stops and undoes what it wrote
        if gone:
            self._metrics.queue_depth.set(self.depth)
            if not self.depth and self._idle is not None:
                self._idle.set()
        return len(gone)

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _next_job(self) -> WriteJob:
        assert self._wakeup is not None
        while True:
            now = time.monotonic()
            ready = [j for j in self._pending
                     if j.not_before <= now and self._by_key[j.key][0] is j]
            if ready:
                self._picks += 1
                local = None
                if self._picks % 2 or _lowest_down(ready):
                    local = [j for j in ready if j.local_left]
                job = min(local or ready, key=_by_seq)
                self._pending.remove(job)
                self._active += 1
                return job
            # Jobs behind an older one of their key are woken when it ends (not polled).
            wait = min((j.not_before for j in self._pending if self._by_key[j.key][0] is j),
                       default=now + 1.0) - now
            # No await between the scan and clear(): a submit cannot slip in unseen.
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=max(wait, 0.001))
            except TimeoutError:
                pass

    async def _worker(self) -> None:
        while True:
            job = await self._next_job()
            try:
                await self._advance(job)
            except asyncio.CancelledError:
                _fail(job, WriteDropped(f"{job.key}: kvstore shut down before the write completed"))
                raise
            except Exception as e:  # a bug must not kill the worker; the job fails loudly
                log.exception("write-behind of %s failed", job.key)
                _fail(job, WriteDropped(f"{job.key}: {e}"))
            finally:
                if job.done.done():  # (not when it was queued again for a retry)
                    self._retire(job)
                    self._wake()  # the key's next write may run now
                self._active -= 1
                self._metrics.queue_depth.set(self.depth)
                if not self.depth and self._idle is not None:
                    self._idle.set()

    async def _advance(self, job: WriteJob) -> None:
        if job.is_chunk and not is_sealed(job.blob):
            await checksum_work(seal_chunk, job.blob)
        while job.next_target < len(job.targets):
            tier = job.targets[job.next_target]
            last = job.next_target == len(job.targets) - 1
            if job.forgotten:
                return await self._abandon(job)
            try:
                await self._put(tier, job.key, job.blob, job.priority)
                if job.forgotten:  # deleted while this put ran: it may have landed after
                    job.next_target += 1
                    return await self._abandon(job)
            except WriteRefused as e:
                if last and job.durable:  # it can never be durable: fail the ack now
                    log.warning("write-behind of %s refused by %s: %s", job.key, tier.name, e)
                    _fail(job, WriteDropped(f"{job.key}: {e}"))
                    return
                log.warning("skipping %s for %s: %s", tier.name, job.key, e)
            except TierUnavailable as e:
                job.attempts += 1
                if (last and job.durable) or job.attempts < LOCAL_ATTEMPTS:
                    self._retry_later(job, e)
                    return
                log.warning("giving up on %s for %s: %s", tier.name, job.key, e)
            job.next_target += 1
            job.local_left = _local_left(job)
            job.attempts = 0
        if not job.done.done():
            job.done.set_result(None)
        if job.durable:
            self._metrics.durable_writes.inc()

    async def _abandon(self, job: WriteJob) -> None:
        """The job's key was deleted while it ran: undo the puts it made, fail its ack."""
        _fail(job, WriteDropped(f"{job.key}: deleted while it was written"))
        if self._undo is not None:
            for tier in job.targets[: job.next_target]:
                try:
                    await self._undo(tier, job.key)
                except TierUnavailable as e:
                    log.warning("could not undo the write of deleted %s in %s: %s",
                                job.key, tier.name, e)

    def _retire(self, job: WriteJob) -> None:
        jobs = self._by_key.get(job.key)
        if jobs is not None:
            with contextlib.suppress(ValueError):
                jobs.remove(job)
            if not jobs:
                del self._by_key[job.key]

    def _retry_later(self, job: WriteJob, err: Exception) -> None:
        pause = min(self._backoff_max_s, self._backoff_s * (2 ** min(job.attempts - 1, 20)))
        job.not_before = time.monotonic() + pause
        log.debug("write-behind %s: %s; retry in %.3fs", job.key, err, pause)
        self._pending.append(job)
        self._drop_if_full()
        self._wake()

    def _drop_if_full(self) -> None:
        if len(self._pending) <= self.bound:
            return
        if _lowest_down(self._pending):
            victim = min(self._pending, key=lambda j: (j.local_left, j.priority, j.seq))
        else:
            victim = min(self._pending, key=lambda j: (j.priority, j.seq))
        self._pending.remove(victim)
        self._retire(victim)
        self.dropped += 1
        self._drop_times.append(time.monotonic())
        self._metrics.dropped_writes.inc()
        log.warning("write-behind queue full (%d): dropped %s", self.bound, victim.key)
        _fail(victim, WriteDropped(f"{victim.key}: write-behind queue full, write dropped"))

    def recent_drops(self, window_s: float = RECENT_DROPS_S) -> int:
        """Jobs dropped in the last ``window_s`` seconds (of the last ``RECENT_DROPS_KEPT``)."""
        since = time.monotonic() - window_s
        return sum(1 for t in self._drop_times if t >= since)

    def check_integrity(self) -> None:
        assert self._active >= 0
        assert len(self._pending) <= self.bound, "queue over its bound"
        assert len({id(j) for j in self._pending}) == len(self._pending), "job queued twice"
        assert all(j in self._by_key.get(j.key, ()) for j in self._pending), "job not keyed"


_by_seq = operator.attrgetter("seq")


def _lowest_down(jobs: list[WriteJob]) -> bool:
    """Whether the lowest tier the durable ones of ``jobs`` go to reports unhealthy."""
    lowest = next((j.targets[-1] for j in jobs if j.durable), None)
    return lowest is not None and not lowest.stats().healthy


def _local_left(job: WriteJob) -> bool:
    """Whether ``job`` still has a target above the lowest tier to write."""
    return job.next_target < len(job.targets) - (1 if job.durable else 0)


def _fail(job: WriteJob, err: Exception) -> None:
    if not job.done.done():
        job.done.set_exception(err)


def _consume(fut: asyncio.Future[None]) -> None:
    # Acks are optional to await; reading the exception keeps asyncio from logging it.
    if not fut.cancelled():
        fut.exception()
