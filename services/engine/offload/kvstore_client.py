"""Async gRPC client of the node's kvstore for one engine pool (event loop only).

    start ──AttachPool (retried with backoff in the background)──► pool_id, blocks_per_chunk
    find_stored_prefix ──LookupPrefix──► spans + lease   (short deadline; error = no reuse)
    find_stored_session ──LookupPrefix(whole_session)──► an advised session's spans
    admission ──LoadIntoPool──► LayerLoaded per layer ──► LayerReadiness (worker waits)
    request end ──SaveFromPool──► reply ──► the core unpins the blocks
    plan dropped ──ReleaseLease
    a load or save that failed on our side ──FencePoolOp──► only then are its blocks let go

The kvstore being down never fails a request: while not attached, lookups answer "nothing
stored", loads fail at once (the request recomputes) and saves are skipped. Any RPC error
drops the attachment and re-attaches in the background (a restarted kvstore has forgotten
the pool). A save refused because the kvstore forgot the pool, or lost with a kvstore
going down, is tried once more after the re-attachment (its blocks stay pinned until
then): the first turn after a kvstore restart keeps its KV.

A load or save whose call ends in an error here (our deadline, a dropped connection) may
still be copying on the kvstore's side: a copy under way runs to its end on a thread. Its
blocks are let go (unparked, unpinned) only after ``FencePoolOp`` for the call's op id
returns, retried until the kvstore answers; a restarted kvstore answers at once (the old
process is gone). Until then the blocks stay out of use: never a wrong KV in a block.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from services.engine.config import EngineConfig
from services.engine.offload import kvstore_wire as wire
from services.engine.offload.jobs import LoadJob, PoolGeometry, SaveJob
from services.engine.offload.save_log import SaveLog
from shared.grpc_server import insecure_channel
from shared.kv_layout import StoredPrefix
from shared.proto import kvstore_pb2_grpc
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 2.0
BACKGROUND_ATTACH_TIMEOUT_S = 30.0
FENCE_TIMEOUT_S = 30.0
SAVE_TASK = "kvstore-save-"
MAX_RECONNECT_BACKOFF_MS = 1000


@dataclass
class ClientStats:
    """Written on the event loop only."""

    lookups: int = 0
    lookup_errors: int = 0
    saves: int = 0
    save_errors: int = 0
    chunks_saved: int = 0


class KVStoreClient:
    def __init__(self, config: EngineConfig, geometry: PoolGeometry,
                 on_attached: Callable[[int], None] | None = None) -> None:
        """Cheap; ``start()`` opens the channel and begins attaching. ``on_attached`` gets
        the kvstore's chunk size in blocks at each attachment."""
        self.config = config
        self.geometry = geometry
        self.model_fp = geometry.model_fp
        self.num_layers = geometry.num_layers
        self.pool_id = ""
        self.blocks_per_chunk = 0
        # The pool was attached and a call just found it forgotten (a kvstore restart):
        # the next save waits for the re-attachment instead of being skipped (once).
        self._pool_lost = False
        self.stats = ClientStats()
        self.saved = SaveLog()  # session saves that landed, for the scheduler
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self._attach_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._warned: set[str] = set()
        self._on_attached = on_attached
        # Op ids for FencePoolOp: unique across engine processes (the kvstore refuses ids
        # it has seen), so a random prefix per client and a counter.
        self._op_prefix = uuid.uuid4().hex[:12]
        self._op_seq = itertools.count()

    @property
    def attached(self) -> bool:
        return bool(self.pool_id)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        # The kvstore is on this node: after it restarts, reconnect within ~0.1-1 s rather
        # than gRPC's default backoff (1 s growing to 120 s).
        self._channel = insecure_channel(
            self.config.offload.kvstore_address, MAX_RECONNECT_BACKOFF_MS
        )
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._ensure_attaching()

    async def close(self, drain_s: float = 5.0) -> None:
        """Let saves in flight finish (up to ``drain_s``: a finished turn's KV is worth
        keeping, and cancelling a save mid-copy leaves the kvstore reading a pool that is
        about to go away), then cancel everything else."""
        saves = [t for t in self._tasks if t.get_name().startswith(SAVE_TASK)]
        if saves:
            await asyncio.wait(saves, timeout=drain_s)
        tasks = [t for t in (self._attach_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._attach_task = None
        self._stub = None
        self.pool_id = ""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _warn(self, what: str, err: BaseException) -> None:
        """Log the first failure of each kind at warning level, the rest at debug."""
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        log.log(level, "kvstore %s at %s failed (KV reuse degrades to recompute): %s",
                what, self.config.offload.kvstore_address, _describe(err))

    # ---- attach -------------------------------------------------------------------------
    def _ensure_attaching(self) -> None:
        if self._stub is not None and (self._attach_task is None or self._attach_task.done()):
            self._attach_task = asyncio.create_task(self._attach_loop(), name="kvstore-attach")

    async def _attach_loop(self) -> None:
        delay = 0.05
        # A long deadline: a kvstore that is still starting (importing torch for the pool
        # path takes seconds) answers late, and every attempt that times out is a warning.
        while not await self.attach(BACKGROUND_ATTACH_TIMEOUT_S):
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.offload.attach_backoff_max_s)

    async def attach(self, timeout: float = ATTACH_TIMEOUT_S) -> bool:
        """One AttachPool attempt (waits up to ``timeout`` for the kvstore to be up)."""
        if self._stub is None:
            return False
        req = wire.attach_request(self.geometry)
        try:
            reply = await self._stub.AttachPool(req, timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            self._warn("AttachPool", e)
            return False
        self.pool_id, self.blocks_per_chunk = wire.attach_reply(reply)
        self._pool_lost = False
        self._warned.clear()
        if self._on_attached is not None:
            self._on_attached(self.blocks_per_chunk)
        log.info("KV pool attached to kvstore %s as %s (%d blocks per chunk)",
                 self.config.offload.kvstore_address, self.pool_id, self.blocks_per_chunk)
        return True

    def _lost(self, err: grpc.aio.AioRpcError) -> None:
        """An RPC failed: if the kvstore is down or restarted (and forgot the pool), attach
        again in the background; other errors (a bad tenant name, a deadline) keep it."""
        if err.code() == grpc.StatusCode.UNAVAILABLE or "AttachPool" in (err.details() or ""):
            self._pool_lost = self._pool_lost or bool(self.pool_id)
            self.pool_id = ""
            self._ensure_attaching()

    # ---- lookup and leases --------------------------------------------------------------
    async def find_stored_prefix(
        self, session: SessionKey, hashes: list[bytes], first_block: int,
        peer: str = "", peer_tokens: int = 0,
    ) -> StoredPrefix | None:
        """The stored prefix beyond ``first_block`` device blocks; None on any error.
        ``peer``: the kvstore that served the session's last turn (of ``peer_tokens``)."""
        if not self.attached or self._stub is None:
            return None
        self.stats.lookups += 1
        req = wire.lookup_request(session, self.model_fp, hashes, first_block,
                                  self.num_layers, peer, peer_tokens)
        o = self.config.offload
        try:
            reply = await self._stub.LookupPrefix(
                req, timeout=o.peer_lookup_timeout_s if peer else o.lookup_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            self.stats.lookup_errors += 1
            self._warn("LookupPrefix", e)
            self._lost(e)
            return None
        return wire.lookup_answer(reply)

    async def find_stored_session(self, session: SessionKey) -> StoredPrefix | None:
        """What the kvstore holds of a session as a whole (an advised prefetch): its
        sequence's block hashes and the leased spans; None on any error or when nothing
        is stored."""
        if not self.attached or self._stub is None:
            return None
        req = wire.lookup_request(session, self.model_fp, [], 0, self.num_layers,
                                  whole_session=True)
        try:
            reply = await self._stub.LookupPrefix(
                req, timeout=self.config.offload.lookup_timeout_s)
        except grpc.aio.AioRpcError as e:
            self._warn("LookupPrefix", e)
            self._lost(e)
            return None
        found = wire.lookup_answer(reply)
        if not found.spans:
            return None
        return found

    def release(self, lease_id: str) -> None:
        if lease_id and self._stub is not None:
            self._spawn(self._release(lease_id), "kvstore-release")

    async def _release(self, lease_id: str) -> None:
        if self._stub is None:
            return
        try:
            await self._stub.ReleaseLease(
                wire.release_request(lease_id),
                timeout=self.config.offload.lookup_timeout_s,
            )
        except grpc.aio.AioRpcError as e:  # the lease expires on its own
            self._warn("ReleaseLease", e)

    # ---- load ---------------------------------------------------------------------------
    def start_load(self, job: LoadJob, ended: Callable[[], None] | None = None) -> None:
        """Begin copying ``job``'s spans into its blocks; progress lands in its readiness;
        ``ended()`` runs once the RPC is over."""
        if not self.attached or self._stub is None:
            job.readiness.fail(0, "the kvstore is not attached")
            job.readiness.finish()
            self.release(job.plan.lease_id)  # a lease from before the kvstore was lost
            if ended is not None:  # as after any load: wakes a worker waiting on parked blocks
                ended()
            return
        self._spawn(self._load(job, ended), f"kvstore-load-{job.request_id}")

    def _new_op_id(self) -> str:
        return f"{self._op_prefix}-{next(self._op_seq)}"

    async def _load(self, job: LoadJob, ended: Callable[[], None] | None) -> None:
        r = job.readiness
        op_id = self._new_op_id()
        req = wire.load_to_proto(job, self.pool_id, self.model_fp, self.num_layers, op_id)
        # The whole call's deadline: every layer may take up to the per-layer wait.
        deadline = self.config.offload.load_timeout_s * 2
        try:
            stub = self._stub
            if stub is None:  # closed since the load was started
                r.fail(0, "the kvstore client is closed")
                return
            async for msg in stub.LoadIntoPool(req, timeout=deadline):
                layer, ok, error = wire.layer_loaded(msg)
                if ok:
                    r.mark_loaded(layer)
                else:
                    r.fail(layer, error or "chunk missing or corrupt")
                    log.warning("load of %s failed at layer %d: %s", job.request_id,
                                layer, error)
        except grpc.aio.AioRpcError as e:
            r.fail(0, _describe(e))
            self._warn("LoadIntoPool", e)
            self._lost(e)
            await self._fence(op_id)  # the kvstore may still be writing into the blocks
        finally:
            r.finish()
            if ended is not None:
                ended()

    async def _fence(self, op_id: str) -> None:
        """Wait until the kvstore says call ``op_id`` can no longer touch the pool, however
        long that takes (its blocks stay out of use meanwhile); gives up only when the
        client closes (the engine is going away with its pool)."""
        delay = 0.05
        while (stub := self._stub) is not None:
            try:
                await stub.FencePoolOp(wire.fence_request(op_id),
                                       timeout=FENCE_TIMEOUT_S, wait_for_ready=True)
                return
            except grpc.aio.AioRpcError as e:
                self._warn("FencePoolOp", e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.offload.attach_backoff_max_s)

    # ---- save ---------------------------------------------------------------------------
    def start_save(self, job: SaveJob, done: Callable[[SaveJob, bool], None]) -> None:
        """Copy ``job``'s blocks into the kvstore; ``done(job, ok)`` runs afterwards in every
        case (it unpins the blocks; not ``ok``: the chunks were not stored)."""
        self._spawn(self._save(job, done), f"{SAVE_TASK}{job.job_id}")

    async def _save(self, job: SaveJob, done: Callable[[SaveJob, bool], None]) -> None:
        ok = False
        try:
            ok = await self._save_once(job, retry=True)
        finally:
            done(job, ok)

    async def _save_once(self, job: SaveJob, retry: bool) -> bool:
        """One SaveFromPool; if the kvstore forgot the pool (restarted) or went away and
        ``retry``, once more after re-attaching. A save that finds the pool being attached
        again (another call saw the kvstore restart) waits for that first; with no
        kvstore at all it is skipped at once."""
        if not self.attached and not (self._pool_lost and await self._reattached()):
            self.stats.save_errors += 1
            return False
        if self._stub is None:
            self.stats.save_errors += 1
            return False
        op_id = self._new_op_id()
        req = wire.save_to_proto(job, self.pool_id, self.model_fp, self.num_layers, op_id)
        try:
            reply = await self._stub.SaveFromPool(
                req, timeout=self.config.offload.save_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            self._warn("SaveFromPool", e)
            self._lost(e)
            await self._fence(op_id)  # the kvstore may still be reading the blocks
            if retry and _pool_lost(e) and await self._reattached():
                log.info("save %s retried on the re-attached kvstore (%s)", job.job_id,
                         _describe(e))
                return await self._save_once(job, retry=False)
            self.stats.save_errors += 1
            return False
        self.stats.saves += 1
        self.stats.chunks_saved += wire.chunks_written(reply)
        if job.session.session_id:
            self.saved.record(job.session, job.token_count)
        return True

    async def _reattached(self) -> bool:
        """Wait (up to the save's deadline) for the background re-attachment under way
        (``_lost`` started it); whether the pool is attached now."""
        task = self._attach_task
        if task is not None and not task.done():
            await asyncio.wait([task], timeout=self.config.offload.save_timeout_s)
        self._pool_lost = False  # (still down: the saves after this one skip at once)
        return self.attached


def _pool_lost(err: grpc.aio.AioRpcError) -> bool:
    """The kvstore is gone (restarting) or restarted and forgot the pool: a call worth
    repeating once the pool is attached again (nothing of it was stored)."""
    return err.code() == grpc.StatusCode.UNAVAILABLE or "unknown pool_id" in (err.details()
                                                                             or "")


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return repr(err)
