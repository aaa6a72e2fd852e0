"""The engine's in-process async API.

    async with AsyncEngine(config) as engine:
        async for out in engine.generate(GenerateRequest(prompt="hi")):
            ...

A facade over three parts, each owning its state:

    worker   (worker/)         the one thread that owns the EngineCore: its inbox of typed
                               commands, the step loop, each step's outputs published
    slot     (model_slot.py)   the model served: loaded weights and their hold on the
                               node's ledger, the core, the kvstore link; activation, eviction
    streams  (streams.py)      the requests here: a queue of outputs per request id

plus ``admission`` (back-pressure: new requests are refused while the engine is behind).

A request: tokenized off the loop, its reuse plan made by the slot's ``ReusePlanner``
(kvstore), then an ``Add`` command; its outputs come back through its stream. With
``kvstore_address`` the core's loads and saves reach the node's kvstore through the link,
whose answers return to the worker as commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from typing import Self

from shared.session_key import SessionKey

from .admission import Admission, Entering
from .api_types import (
    EngineStatus,
    GenerateOutput,
    GenerateRequest,
    ModelInfo,
    ReuseStats,
)
from .config import EngineConfig
from .engine_core import EngineCore
from .errors import UNAVAILABLE, EngineError
from .input_size import check_input_size, estimate_tokens
from .model import LoadedModel
from .model.mapped import StoredWeights
from .model_slot import ModelSlot, idle_status
from .offload import RECOMPUTE, KVStoreClient, SavedSession
from .process_memory import limit_arenas
from .streams import RequestStreams
from .validation import PreparedRequest, prepare
from .worker import Abort, Add, EndPrefetch, Prefetch, Worker

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Cheap: nothing is loaded or started until ``start()``. ``loaded`` (a LoadedModel)
        skips loading ``config.model_path``."""
        self._admission = Admission(config.max_waiting, config.max_queue_delay_s)
        self._streams = RequestStreams()
        self._worker = Worker(self._streams)
        self._slot = ModelSlot(config, loaded, self._worker, self._streams)

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration, with the served model's path."""
        return self._slot.config

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the worker; load and serve ``config.model_path`` if given. Without one (a
        standby engine) it waits among its node's standby engines for ``activate``."""
        limit_arenas()  # before the worker's and OpenMP's threads make arenas of their own
        await self._worker.start(self.config.threads)
        try:
            await self._slot.load_configured()
        except BaseException:
            self._worker.abandon()
            raise
        await self._slot.open()

    async def stop(self) -> None:
        await self._slot.close("the engine is shutting down")
        self._worker.shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def activate(self, model_path: str, served_name: str = "",
                       stored: StoredWeights | None = None) -> ModelInfo:
        """Serve ``model_path`` in this running engine (see ``ModelSlot.activate``)."""
        return await self._slot.activate(model_path, served_name, stored)

    @property
    def last_fill(self) -> tuple[int, float]:
        """(bytes, seconds) the last activation wrote into the node's weight arena."""
        return self._slot.last_fill

    async def evict(self) -> bool:
        """Stop serving the active model; whether one was (see ``ModelSlot.evict``)."""
        return await self._slot.evict()

    def _require_core(self) -> EngineCore:
        core = self._slot.core
        if core is None or not self._worker.stepping:
            raise EngineError(UNAVAILABLE, "no model is active in this engine" if
                              self._worker.running else "the engine is not running")
        return core

    @property
    def model_info(self) -> ModelInfo:
        return self._require_core().model_info

    @property
    def loaded(self) -> LoadedModel | None:
        """The model served (None: none)."""
        return self._slot.loaded

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, coalesce: bool = False
                       ) -> AsyncGenerator[GenerateOutput, None]:
        """Stream a request's outputs. Raises EngineError (before the first output for bad
        input). Closing or cancelling the iterator early aborts the request. ``coalesce``:
        outputs that piled up while the consumer was busy come as one (the gRPC server's
        stream: under load a message per step and request costs more than the step)."""
        core = self._require_core()
        parts = check_input_size(req, core.max_model_len)  # (refused before any work)
        self._admit(bound_delay=not req.node_admitted, waited_s=req.waited_s)
        # Counted as queued until it reaches the inbox, with its prompt's estimated tokens.
        entry = self._admission.enter(estimate_tokens(parts))
        try:
            with self._streams.session(SessionKey(req.tenant, req.session_id)):
                async with contextlib.aclosing(self._generate(core, req, entry, coalesce)
                                               ) as outputs:
                    async for out in outputs:
                        yield out
        finally:
            entry.leave()

    async def _generate(self, core: EngineCore, req: GenerateRequest, entry: Entering,
                        coalesce: bool) -> AsyncGenerator[GenerateOutput, None]:
        loaded = self._slot.loaded
        assert loaded is not None
        prepared: PreparedRequest = await asyncio.to_thread(
            prepare, req, tokenizer=loaded.tokenizer, model_name=loaded.name,
            vocab_size=loaded.config.vocab_size, max_model_len=core.max_model_len,
            fingerprint=loaded.fingerprint, guidance=self._slot.guidance)
        rid = prepared.request_id
        # The id is claimed before planning: a second call with it (a client retry) is
        # refused instead of reaching the core as a second sequence under one id.
        queue = self._streams.open(rid)
        submitted = finished = False
        try:
            planner = self._slot.planner
            with self._streams.planning(rid):
                plan = (await planner.plan(prepared)
                        if planner is not None and not prepared.no_reuse
                        and not prepared.device_only else None)
            aborted = self._streams.take_abort(rid)
            # Stopped or restarted during planning, or aborted meanwhile.
            if self._slot.core is not core or self._worker.stopping or aborted:
                if plan is not None and planner is not None:
                    planner.release(plan)
                if not aborted:
                    raise EngineError(UNAVAILABLE, "the engine is shutting down")
                finished = True
                n = len(prepared.prompt_token_ids)
                yield GenerateOutput(rid, "", (), n, 0, 0, "abort",
                                     tuple(prepared.prompt_token_ids))
                return
            entry.leave()
            reused = plan.end_block * self.config.block_size if plan is not None else 0
            self._worker.submit(Add(prepared, plan),
                                max(1, len(prepared.prompt_token_ids) - reused))
            submitted = True
            while not finished:
                try:
                    out = await self._streams.next_output(queue, coalesce)
                except EngineError:
                    finished = True
                    raise
                finished = out.finish_reason is not None
                yield out
        finally:
            self._streams.close(rid, queue)
            if submitted and not finished:
                self._worker.submit(Abort(rid))

    def _admit(self, bound_delay: bool = True, waited_s: float = 0.0) -> None:
        """Raise RESOURCE_EXHAUSTED when the queue is full or (``bound_delay``) too far
        behind for a request that has already waited ``waited_s`` on its way here."""
        snap, running_s = self._worker.snapshot, self._worker.step_running_s()
        self._admission.check(
            self._worker.queued + self._admission.entering,
            snap.oldest_waiting_since if snap is not None else 0.0,
            time.monotonic(),
            bound_delay,
            snap.queue if snap is not None else None,
            waited_s,
            self._worker.pending_tokens,
            # (the step under way, priced as a decode step: the one it most often is)
            max(0.0, snap.queue.decode_step_s - running_s) if snap and running_s else 0.0,
        )

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was still active (its stream then ends with
        finish_reason "abort"). Its blocks are free on return."""
        self._require_core()
        active = self._streams.is_open(request_id)
        if self._streams.abort_planning(request_id):  # not in the core yet: it ends when
            return True  # its planning does
        await self._worker.send(Abort(request_id))
        return active

    # ---- status -------------------------------------------------------------------------
    async def status(self, max_wait_s: float | None = None) -> EngineStatus:
        """The core's counters after the queued commands. With ``max_wait_s``, when the
        worker is busy longer than that (a long forward pass), the snapshot of the last
        step instead: liveness and load must not wait for the model. An engine without a
        model (a standby one) answers with no model and no KV pool, and so does one
        between models (an activation or eviction under way): it is not down."""
        if self._worker.running and (
                self._slot.core is None or (not self._worker.stepping and self._slot.switching)):
            return idle_status(self.config)
        self._require_core()
        status = await self._worker.status(max_wait_s)
        return dataclasses.replace(status, reuse=self._reuse_stats(status.reuse))

    def _reuse_stats(self, core_stats: ReuseStats) -> ReuseStats:
        link = self._slot.link
        if link is not None:
            return link.stats(core_stats)
        return dataclasses.replace(core_stats, mode=RECOMPUTE if
                                   self.config.offload.mode == RECOMPUTE else "device")

    def step_running_s(self) -> float:
        """How long the forward step under way has run (0.0: the worker is not stepping)."""
        return self._worker.step_running_s()

    def saved_after(self, seq: int) -> tuple[SavedSession, ...]:
        """Session saves that landed, numbered above ``seq`` (see ``offload/save_log``)."""
        link = self._slot.link
        return link.saved_after(seq) if link is not None else ()

    @property
    def kv_connector(self) -> KVStoreClient | None:
        """The node's kvstore client (None without ``kvstore_address`` or in recompute)."""
        link = self._slot.link
        return link.client if link is not None else None

    # ---- advisories ---------------------------------------------------------------------
    async def prefetch(self, tenant: str, session_id: str, *, priority: int = 0,
                       ttl_s: float = 30.0, straight: bool = False) -> int:
        """An advised session: copy what the node's kvstore holds of it into free device
        blocks (``straight``: evicting the device cache if need be), lowest layers first;
        how many blocks of it the kvstore holds (0: nothing to prefetch)."""
        self._require_core()
        link, session = self._slot.link, SessionKey(tenant, session_id)
        if link is None or not session_id or self._streams.has_session(session):
            return 0
        order = await link.find_session(session, priority, ttl_s, straight)
        if order is None:
            return 0
        # Its request came during the lookup (too late to prefetch), or the engine stops.
        if self._streams.has_session(session) or self._worker.stopping:
            link.release(order.plan)
            return 0
        await self._worker.send(Prefetch(order))  # its loads have started (or it got no
        return order.plan.end_block  # memory) on return

    def end_prefetch(self, tenant: str, session_id: str, expired: bool = False) -> None:
        """The session's advisory ended unfollowed: its prefetched device blocks are freed
        (invalidated) or become the first to purge (``expired``)."""
        self._require_core()
        self._worker.submit(EndPrefetch(SessionKey(tenant, session_id), expired))

    # ---- memory -------------------------------------------------------------------------
    async def drop_device_cache(self) -> int:
        """Evict every evictable block from the device prefix cache (benchmarks, tests:
        forces the next request to load its history from the kvstore); how many."""
        core = self._require_core()
        await self._worker.flush()
        return await self._worker.run(core.drop_cached)

    async def shrink_kv(self, max_pages: int) -> int:
        """Give back up to ``max_pages`` pages of KV memory not holding running KV."""
        core = self._require_core()
        await self._worker.flush()
        return await self._worker.run(core.shrink, max_pages)

    async def lend_to_node(self, layers: int) -> tuple[int, int]:
        """Lend (< 0: take back) layers' weight memory to the node's budget (MIRAGE §5.2);
        the layers and bytes lent to it now."""
        core = self._require_core()
        if core.remap is None or not layers:  # (remapping off: nothing to lend)
            return (core.remap.node_layers if core.remap else 0), core.pool.node_lent_bytes
        await self._worker.flush()
        n = await self._worker.run(core.remap.lend_to_node, layers)
        return n, core.pool.node_lent_bytes

    async def check_integrity(self) -> None:
        await self._worker.run(self._require_core().check_integrity)
