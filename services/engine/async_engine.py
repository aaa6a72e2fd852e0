"""The engine's in-process async API.

    async with AsyncEngine(config) as engine:
        async for out in engine.generate(GenerateRequest(prompt="hi")):
            ...

Threads: the event loop never runs model code. One dedicated worker thread owns the
EngineCore (its side of the class is ``WorkerLoop``, worker_loop.py); every touch of it
(adding, aborting, stepping, status) runs there, in order.
Requests and aborts wait in an inbox (a deque; appends are atomic) that the worker drains
before each step. A step-loop task sleeps on an asyncio.Event until work arrives, then
hands the worker a stepping run: the worker steps back to back while there is work and
posts each step's outputs to the loop (call_soon_threadsafe), which routes them to their
requests' queues while the next step already runs. A run ends after the step during which
another worker job (abort, shrink) was queued, so those wait at most one step.

Status never waits behind a forward pass: each step publishes a snapshot of the core's
counters with its outputs, and ``status(max_wait_s)`` answers from it when the worker does
not answer sooner (a busy engine is not a dead one). New requests are refused while the
engine is behind (``admission``).

KV reuse (with ``kvstore_address``): ``generate`` asks the PrefixLookup what of the
prompt to load from the node's kvstore before the request enters the core; the core's
loads and saves come back to the loop through a LoopTransport, and a save's pinned blocks
return to the worker as an inbox command.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import torch

from shared.device_ledger import DeviceLedger
from shared.session_key import SessionKey

from .admission import Admission, Entering
from .api_types import (
    EngineStatus,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    ReuseStats,
    merge_outputs,
)
from .config import EngineConfig
from .engine_core import EngineCore
from .errors import INVALID_ARGUMENT, UNAVAILABLE, EngineError
from .guidance import ModelGuidance
from .loading import load_for
from .model_slot import ModelSlot, idle_status
from .offload.device_prefetch import PrefetchOrder
from .offload.kvstore_client import KVStoreClient
from .offload.lookup import PrefixLookup, connect_offload
from .offload.planner import RECOMPUTE, ReusePlan
from .offload.save_log import SavedSession
from .validation import PreparedRequest, prepare
from .worker_loop import ABORT, ADD, END_PREFETCH, PREFETCH, UNPIN, WorkerLoop

log = logging.getLogger(__name__)



class AsyncEngine(WorkerLoop, ModelSlot):
    def __init__(self, config: EngineConfig, loaded: Any = None) -> None:
        """Cheap: nothing is loaded or started until ``start()``. ``loaded`` (a LoadedModel)
        skips loading ``config.model_path``."""
        self.config = config
        self._loaded = loaded
        self._core: EngineCore | None = None
        self._guidance: ModelGuidance | None = None
        self._ledger: DeviceLedger | None = None  # the node's shared budget (device_ledger)
        self._weights_held = 0
        # Held while a model is activated or evicted (model_slot.py): one at a time.
        self._switch_lock = asyncio.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task | None = None
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[GenerateOutput | EngineError]] = {}
        self._in_lookup: set[str] = set()  # request ids whose kvstore lookup is under way
        # (tenant, session id) -> requests of it in this engine now: an advisory's prefetch
        # comes too late for a session whose request is here already.
        self._active_sessions: dict[SessionKey, int] = {}
        self._aborted_in_lookup: set[str] = set()
        self._waiting_snapshot = 0
        self._pending_adds = 0
        # Worker jobs queued by the loop besides stepping runs; only the loop writes it.
        self._side_jobs = 0
        self._stopping = False
        self._connector: KVStoreClient | None = None
        self._coordinator: PrefixLookup | None = None
        self._snapshot: EngineStatus | None = None  # the core's counters after the last step
        self._fresh: asyncio.Future[EngineStatus] | None = None  # a Status's worker question
        self._step_started = 0.0  # (worker) monotonic start of the step under way; 0: idle
        self._admission = Admission(config.max_waiting, config.max_queue_delay_s)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the worker; load and serve ``config.model_path`` if given. Without one the
        engine waits in its node's pool for ``activate`` (Prism §5.2)."""
        self._stopping = False
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        # OpenMP settings are per calling thread: give the worker the same intra-op team.
        await self._in_worker(torch.set_num_threads, torch.get_num_threads())
        if self._loaded is None and (self.config.model_path or not self.config.pool):
            # Loaded in the worker as well: each thread that runs parallel torch ops keeps its
            # own OpenMP team, and with more team threads than cores libgomp stops spinning
            # between parallel regions; that doubled one-row decode steps on 2 cores.
            try:
                self._loaded = await self._in_worker(load_for, self.config)
            except BaseException:
                self._executor.shutdown(wait=False)
                self._executor = None
                raise
        if self.config.device_ledger:
            self._ledger = DeviceLedger(self.config.device_ledger)
            self._ledger.join()
        if self._loaded is not None:
            await self._serve_loaded()
        else:
            log.info("engine started without a model: waiting for one to be activated")

    async def _serve_loaded(self) -> None:
        """Build the core (its KV pool laid out for the loaded model), attach the kvstore,
        start stepping. With a node ledger the weights are counted first."""
        self._hold_weights()
        try:
            self._core = await self._in_worker(EngineCore, self.config, self._loaded,
                                               self._ledger)
        except BaseException:
            self._release_weights()
            raise
        self._guidance = ModelGuidance(
            self._loaded.tokenizer, self._loaded.config.vocab_size,
            self._loaded.config.eos_token_ids, self.config.tool_parser)
        self._snapshot = await self._in_worker(self._core.status)
        await self._start_reuse()
        self._loop_task = asyncio.create_task(self._step_loop(), name="engine-step-loop")
        info = self._core.model_info
        log.info(
            "engine serving %s: context %d, KV pool %d blocks of %d bytes at %s",
            info.name,
            info.max_model_len,
            self._core.pool.num_blocks,
            self._core.pool.block_bytes,
            self._core.pool.name,
        )

    async def _stop_serving(self, why: str) -> None:
        self._stopping = True  # ends the worker's stepping run after its current step
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._connector is not None:
            await self._connector.close()
            self._connector = self._coordinator = None
        for q in self._queues.values():
            q.put_nowait(EngineError(UNAVAILABLE, why))
        if self._executor is not None and self._core is not None:
            await self._in_worker(self._core.close)
        self._core = None
        self._inbox.clear()
        self._stopping = False

    async def stop(self) -> None:
        await self._stop_serving("the engine is shutting down")
        self._release_weights()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        self._stopping = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _require_core(self) -> EngineCore:
        if self._core is None or self._loop_task is None:
            raise EngineError(UNAVAILABLE, "no model is active in this engine" if
                              self._executor is not None else "the engine is not running")
        return self._core

    @property
    def model_info(self) -> ModelInfo:
        return self._require_core().model_info

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, coalesce: bool = False
                       ) -> AsyncGenerator[GenerateOutput, None]:
        """Stream a request's outputs. Raises EngineError (before the first output for bad
        input). Closing or cancelling the iterator early aborts the request. ``coalesce``:
        outputs that piled up while the consumer was busy come as one (the gRPC server's
        stream: under load a message per step and request costs more than the step)."""
        core = self._require_core()
        self._admit(bound_delay=not req.node_admitted)
        entry = self._admission.enter()  # counted as queued until it reaches the inbox
        session = SessionKey(req.tenant, req.session_id)
        self._active_sessions[session] = self._active_sessions.get(session, 0) + 1
        try:
            async with contextlib.aclosing(self._generate(core, req, entry, coalesce)
                                           ) as outputs:
                async for out in outputs:
                    yield out
        finally:
            entry.leave()
            left = self._active_sessions.pop(session) - 1
            if left:
                self._active_sessions[session] = left

    async def _generate(
        self, core: EngineCore, req: GenerateRequest, entry: Entering, coalesce: bool = False
    ) -> AsyncGenerator[GenerateOutput, None]:
        prepared: PreparedRequest = await asyncio.to_thread(
            prepare,
            req,
            tokenizer=self._loaded.tokenizer,
            model_name=self._loaded.name,
            vocab_size=self._loaded.config.vocab_size,
            max_model_len=core.max_model_len,
            fingerprint=self._loaded.fingerprint,
            guidance=self._guidance,
        )
        rid = prepared.request_id
        if rid in self._queues:
            raise EngineError(INVALID_ARGUMENT, f"request id {rid!r} is already running")
        # The id is claimed before the lookup: a second call with it (a client retry) is
        # refused instead of reaching the core as a second sequence under one id.
        queue: asyncio.Queue[GenerateOutput | EngineError] = asyncio.Queue()
        self._queues[rid] = queue
        submitted = finished = False
        core_now = self._core
        try:
            coordinator = self._coordinator
            self._in_lookup.add(rid)
            try:
                plan = (await coordinator.plan(prepared)
                        if coordinator and not prepared.no_reuse else None)
            finally:
                self._in_lookup.discard(rid)
            aborted = rid in self._aborted_in_lookup
            self._aborted_in_lookup.discard(rid)
            if self._stopping or self._core is not core_now or aborted:
                if plan is not None and coordinator is not None:
                    coordinator.connector.release(plan.lease_id)
                if not aborted:  # stopped (or restarted) during the lookup
                    raise EngineError(UNAVAILABLE, "the engine is shutting down")
                finished = True
                n = len(prepared.prompt_token_ids)
                yield GenerateOutput(rid, "", (), n, 0, 0, "abort",
                                     tuple(prepared.prompt_token_ids))
                return
            entry.leave()
            self._submit(ADD, (prepared, plan))
            submitted = True
            while not finished:
                item = await queue.get()
                if coalesce:  # outputs that queued up while the consumer was busy: one
                    while not isinstance(item, EngineError) and item.finish_reason is None \
                            and not queue.empty():
                        nxt = queue.get_nowait()
                        item = nxt if isinstance(nxt, EngineError) else merge_outputs(item, nxt)
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if self._queues.get(rid) is queue:
                del self._queues[rid]
            if submitted and not finished:
                self._submit(ABORT, rid)

    def _admit(self, bound_delay: bool = True) -> None:
        """Raise RESOURCE_EXHAUSTED when the queue is full or (``bound_delay``) too far
        behind."""
        snap = self._snapshot
        self._admission.check(
            self._waiting_snapshot + self._pending_adds + self._admission.entering,
            snap.oldest_waiting_since if snap is not None else 0.0,
            time.monotonic(),
            bound_delay,
        )

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was still active (its stream then ends with
        finish_reason "abort"). Its blocks are free on return."""
        self._require_core()
        active = request_id in self._queues
        if request_id in self._in_lookup:  # not in the core yet: it ends when its lookup does
            self._aborted_in_lookup.add(request_id)
            return True
        self._inbox.append((ABORT, request_id))
        await self._run_inbox()
        return active

    async def status(self, max_wait_s: float | None = None) -> EngineStatus:
        """The core's counters after the queued adds and aborts. With ``max_wait_s``, when
        the worker is busy longer than that (a long forward pass), the snapshot of the last
        step instead: liveness and load must not wait for the model. An engine without a
        model (waiting in its node's pool) answers with no model and no pool, and so does
        one between models (an activation or eviction under way): it is not down."""
        if self._executor is not None and (
                self._core is None or (self._loop_task is None and self._switch_lock.locked())):
            return idle_status(self.config)
        core = self._require_core()
        if max_wait_s is None:
            fresh: asyncio.Future[EngineStatus] = asyncio.ensure_future(self._fresh_status(core))
        else:
            # One fresh question in flight at most: a wedged worker must not pile them up.
            if self._fresh is None or self._fresh.done():
                self._fresh = asyncio.ensure_future(self._fresh_status(core))
                self._fresh.add_done_callback(_retrieve)
            fresh = self._fresh
        if max_wait_s is None:
            status = await fresh
        else:
            try:
                status = await asyncio.wait_for(asyncio.shield(fresh), max_wait_s)
            except TimeoutError:
                assert self._snapshot is not None  # (taken at start)
                status = dataclasses.replace(self._snapshot, step_started=self._step_started)
        return dataclasses.replace(status, reuse=self._reuse_stats(status.reuse))

    async def _fresh_status(self, core: EngineCore) -> EngineStatus:
        await self._run_inbox()
        status: EngineStatus = await self._in_worker(core.status)
        return status

    def _reuse_stats(self, core_stats: ReuseStats) -> ReuseStats:
        c = self._connector
        if c is None:
            return dataclasses.replace(core_stats, mode=RECOMPUTE if
                                       self.config.offload.mode == RECOMPUTE else "device")
        return dataclasses.replace(
            core_stats, mode=self.config.offload.mode, attached=c.attached,
            lookups=c.stats.lookups, lookup_errors=c.stats.lookup_errors,
            saves=c.stats.saves, save_errors=c.stats.save_errors,
            chunks_saved=c.stats.chunks_saved,
        )

    def step_running_s(self) -> float:
        """How long the forward step under way has run (0.0: the worker is not stepping)."""
        started = self._step_started
        return time.monotonic() - started if started else 0.0

    def saved_after(self, seq: int) -> tuple[SavedSession, ...]:
        """Session saves that landed, numbered above ``seq`` (see ``offload/save_log``)."""
        return self._connector.saved.after(seq) if self._connector is not None else ()

    @property
    def kv_connector(self) -> KVStoreClient | None:
        """The node's kvstore client (None without ``kvstore_address`` or in recompute)."""
        return self._connector

    async def prefetch(self, tenant: str, session_id: str, *, priority: int = 0,
                       ttl_s: float = 30.0, straight: bool = False) -> int:
        """An advised session: copy what the node's kvstore holds of it into free device
        blocks (``straight``: evicting the device cache if need be), lowest layers first;
        how many blocks of it the kvstore holds (0: nothing to prefetch)."""
        self._require_core()
        c = self._connector
        if c is None or not session_id or SessionKey(tenant, session_id) in self._active_sessions:
            return 0
        found = await c.lookup_session(tenant, session_id)
        if found is None:
            return 0
        if SessionKey(tenant, session_id) in self._active_sessions:  # it came during the lookup
            c.release(found.lease_id)
            return 0
        n = found.spans[-1].end_block
        hashes = found.block_hashes[:n]
        if self._stopping or found.spans[0].first_block != 0 or len(hashes) < n:
            c.release(found.lease_id)
            return 0
        plan = ReusePlan(tuple(found.spans), found.lease_id, 0, n)
        self._inbox.append((PREFETCH, PrefetchOrder(tenant, session_id, hashes, plan,
                                                     priority, ttl_s, straight)))
        await self._run_inbox()  # its loads have started (or it got no memory) on return
        return n

    def end_prefetch(self, tenant: str, session_id: str, expired: bool = False) -> None:
        """The session's advisory ended unfollowed: its prefetched device blocks are freed
        (invalidated) or become the first to purge (``expired``)."""
        self._require_core()
        self._submit(END_PREFETCH, (tenant, session_id, expired))

    async def drop_device_cache(self) -> int:
        """Evict every evictable block from the device prefix cache (benchmarks, tests:
        forces the next request to load its history from the kvstore); how many."""
        core = self._require_core()
        await self._run_inbox()
        return await self._in_worker(core.drop_cached)

    async def _start_reuse(self) -> None:
        """Connect the pool to the node's kvstore (attaching in the background). Runs
        before the step loop starts: the worker reads the transport only while stepping."""
        if self.config.offload.kvstore_address and self.config.offload.mode != RECOMPUTE:

            def unpin(job: int | None, ok: bool = True) -> None:
                self._submit(UNPIN, (job, ok))

            self._connector, self._coordinator = await connect_offload(
                self.config, self._worker_core(), self._loaded.config, unpin)

    async def shrink_kv(self, max_pages: int) -> int:
        """Give back up to ``max_pages`` pages of KV memory not holding running KV."""
        core = self._require_core()
        await self._run_inbox()
        return await self._in_worker(core.shrink, max_pages)

    async def check_integrity(self) -> None:
        await self._in_worker(self._require_core().check_integrity)



def _retrieve(fut: asyncio.Future) -> None:
    """Take a background future's exception (one nobody awaited: a stopped engine)."""
    if not fut.cancelled():
        fut.exception()
