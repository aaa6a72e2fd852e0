"""The KVStore gRPC servicer: a thin edge over the chunk store, the manifest store and the
engine-pool path. Requests and replies go through ``wire.py``; nothing here touches a
protobuf field."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from services.kvstore import wire
from services.kvstore.engine_path.attach import PoolError
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.errors import ManifestIncomplete, StorageError, TierUnavailable
from services.kvstore.manifests import ManifestStore, manifest_key
from services.kvstore.manifests.listing import MAX_PAGE, list_sessions
from services.kvstore.peers.pull import pull_session
from services.kvstore.staging import SessionStager, stage_session
from services.kvstore.streaming import stream_session
from shared.chunk_codec import MAX_LAYER, ChunkCorrupt, ChunkFormatError
from shared.config import ConfigError
from shared.proto import kvstore_pb2 as pb
from shared.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        manifests: ManifestStore,
        node_id: str,
        window: int,
        peer_address: str,
        pool_path: EnginePoolPath,
        peer_timeout_s: float = 10.0,
        prefetch_join_s: float = 1.0,
    ) -> None:
        self.manifests = manifests
        self.store = manifests.store
        self.peer_timeout_s = peer_timeout_s
        self.pool_path = pool_path
        self.node_id = node_id
        self.window = window
        self.peer_address = peer_address
        self.staging = SessionStager()
        self.prefetch_join_s = prefetch_join_s

    async def Status(
        self, request: pb.KVStoreStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVStoreStatus:
        healthy, detail = self.store.health()
        m = self.store.metrics
        failures = sum(
            m.value("kvstore_checksum_failures_total", tier=t)
            for t in [*(x.name for x in self.store.tiers), "peer"]
        )
        return wire.status_reply(self.node_id, healthy, detail, self.store.stats(),
                                 self.store.writer.depth, self.store.writer.dropped,
                                 int(failures))

    async def GetChunks(
        self, request: pb.GetChunksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChunkData]:
        # The client may ask for less read-ahead than the configured bound, never more:
        # each chunk in flight is a blob held in memory.
        q = wire.chunks_query(request)
        window = min(q.window or self.window, self.window)
        if q.keys:
            await _check_key_count(context, len(q.keys))
            for i, key in enumerate(q.keys):
                blob = await self.store.get_blob(key)
                yield wire.chunk_to_pb(key, blob, layer=_layer_of(key), index=i)
            return
        try:
            manifest = await self.manifests.newest_manifest(q.tenant, q.session_id)
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        if manifest is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no manifest for this session")
            return
        first, last = q.first_layer, q.last_layer
        if first >= manifest.num_layers or (
                last is not None and not first <= last < manifest.num_layers):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"layers [{first}, {last}] are not within the session's "
                f"{manifest.num_layers} layers (first <= last required)")
        stream = stream_session(self.store, manifest, first, last, window)
        async for layer, index, key, blob in stream:
            # grpc's write awaits HTTP/2 flow control, so the read-ahead stays bounded.
            yield wire.chunk_to_pb(key, blob, layer, index)

    async def PutChunks(
        self, request_iterator: AsyncIterator[pb.ChunkData], context: grpc.aio.ServicerContext
    ) -> pb.PutChunksReply:
        stored = rejected = 0
        wait = False
        receipts = []
        detail = ""
        async for raw in request_iterator:
            msg = wire.chunk_from_pb(raw)
            wait = wait or msg.wait_durable
            try:
                receipts.append(await self.store.put_blob(msg.blob, msg.priority))
                stored += 1
            except ChunkCorrupt as e:
                rejected += 1
                detail = f"{msg.key[:200]}: {e}"
                if rejected > MAX_REJECTED_PER_CALL:  # a client sending garbage: stop reading
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"more than {MAX_REJECTED_PER_CALL} malformed chunks in one call "
                        f"({stored} stored before); last: {detail}")
        not_durable = 0
        if wait:
            for r in receipts:
                try:
                    await r.durable
                except StorageError as e:
                    not_durable += 1
                    detail = str(e)
        return wire.put_chunks_reply(stored, rejected, not_durable, detail)

    async def GetManifest(
        self, request: pb.ManifestRef, context: grpc.aio.ServicerContext
    ) -> pb.ManifestReply:
        sid = wire.session_of(request)
        try:
            manifest_key(*sid)  # (ChunkFormatError, before any wait)
            if sid.session_id and request.wait_tokens:  # a peer staging it: the turn's save
                await self.manifests.saves.wait(sid, request.wait_tokens,
                                                self.pool_path.peer_wait_s, turn=True)
            m = await self.manifests.newest_manifest(*sid)
            if m is None and not request.model_fp:  # (any model's, when it names none)
                for scoped in self.manifests.model_scopes(*sid):
                    m = m or await self.manifests.newest_manifest(sid.tenant, scoped)
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return wire.manifest_reply(m)

    async def PutManifest(
        self, request: pb.SessionManifest, context: grpc.aio.ServicerContext
    ) -> pb.PutManifestReply:
        try:
            await self.manifests.put_manifest(wire.manifest_from_pb(request))
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (ManifestIncomplete, TierUnavailable) as e:
            return wire.put_manifest_reply(False, str(e))
        return wire.put_manifest_reply(True, "ok")

    async def Stat(
        self, request: pb.StatRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatReply:
        keys = wire.keys_of(request)
        await _check_key_count(context, len(keys))
        return wire.stat_reply([(k, await self.store.locate(k)) for k in keys])

    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteReply:
        q = wire.delete_query(request)
        tiers = list(q.tiers)
        try:
            self.store.check_tier_names(tiers)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await _check_key_count(context, len(q.keys))
        if q.session_id:
            try:  # before anything is done with the names
                manifest_key(q.tenant, q.session_id)
            except ChunkFormatError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        everywhere = not tiers or self.store.lowest.name in tiers
        n = 0
        for k in q.keys:
            n += await self.store.delete(k, tiers)
        if q.session_id:
            tenant = q.tenant
            # Without a model: the session under every model this node knows it for.
            names = [q.session_id] + ([] if request.session.model_fp else
                                      self.manifests.model_scopes(tenant, q.session_id))
            for sid in names:
                if everywhere:  # the session is gone, not just evicted from faster tiers
                    await self.manifests.forget(tenant, sid)
                try:
                    m = await self.manifests.get_manifest(tenant, sid)
                    if m is not None and q.with_chunks:
                        for k in m.chunk_keys():
                            n += await self.store.delete(k, tiers)
                    n += await self.manifests.delete_manifest(tenant, sid, tiers)
                except ChunkFormatError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return wire.delete_reply(n)

    async def PrefetchSession(
        self, request: pb.PrefetchSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.PullSessionReply:
        tenant, session_id = wire.session_of(request.session)
        try:
            r = await self.staging.run(tenant, session_id, stage_session(
                self.manifests, tenant, session_id, request.peer_address, self.window,
                self.peer_timeout_s, request.wait_tokens, self.pool_path.peer_wait_s),
                peer=request.peer_address)
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        m = self.store.metrics
        m.prefetches.labels("found" if r.found else "none").inc()
        m.prefetched_bytes.inc(r.bytes)
        return wire.pull_reply(r.found, r.chunks, r.missing, r.bytes, r.detail)

    async def PullSession(
        self, request: pb.PullSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.PullSessionReply:
        q = wire.pull_query(request)
        peer = q.peer_address or self.peer_address
        if not peer:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "no peer_address given and kvstore.peer_address is empty",
            )
        try:
            r = await pull_session(
                self.manifests,
                peer,
                q.tenant,
                q.session_id,
                q.first_layer,
                self.window,
                write_manifest=q.wait_durable,
                timeout_s=self.peer_timeout_s,
            )
        except TierUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return wire.pull_reply(r.found, r.chunks, r.missing, r.bytes, r.detail)

    # ------------------------------------------------ same-node data path (engine_path/)

    async def AttachPool(
        self, request: pb.AttachPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttachPoolReply:
        try:
            pool_id, bpc = await self.pool_path.attach(wire.geometry_from_pb(request.pool))
        except ConfigError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (PoolError, ImportError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return wire.attach_reply(pool_id, bpc)

    async def LookupPrefix(
        self, request: pb.LookupPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupPrefixReply:
        try:
            req = wire.lookup_from_pb(request)
            left = context.time_remaining()
            budget = self.prefetch_join_s if left is None else min(self.prefetch_join_s,
                                                                   left / 2)
            # The session's staging for an advisory still running here: let it land first,
            # unless it pulls from the peer this request streams from itself (stopped:
            # faster).
            if not self.staging.stop_pull_from(req.tenant, req.session_id, req.peer_address):
                await self.staging.join(req.tenant, req.session_id, budget)
            result = await self.pool_path.lookup(req)
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._hand_out(result.lease_id, context)
        return wire.lookup_to_pb(result)

    async def _hand_out(self, lease_id: str, context: grpc.aio.ServicerContext) -> None:
        """A caller gone before the reply never learns the lease id: end the lease here
        rather than let it pin chunks until it expires. Past the caller's deadline (which
        the server sees as time run out, not as a cancellation) the reply cannot arrive; a
        disconnect shows as a cancelled call once it is over."""
        if not lease_id:
            return
        left = context.time_remaining()
        if left is not None and left <= 0:
            self.pool_path.release(lease_id)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "lookup past its deadline")
        context.add_done_callback(
            lambda ctx: self.pool_path.release(lease_id) if ctx.cancelled() else None)

    async def LoadIntoPool(
        self, request: pb.LoadIntoPoolRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LayerLoaded]:
        try:
            # aclosing: a dropped call finishes the load's clean-up before it ends (see
            # EnginePoolPath.load): no pool write after the RPC.
            load = self.pool_path.load(wire.load_from_pb(request))
            async with contextlib.aclosing(load) as layers:
                async for msg in layers:
                    yield wire.layer_to_pb(msg)
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def FindPrefix(
        self, request: pb.FindPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindPrefixReply:
        try:
            found = await self.pool_path.answer_peer(wire.find_from_pb(request))
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._hand_out(found.lease_id, context)  # (it may have waited for a save)
        return wire.find_reply(found)

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsReply:
        held, cursor = await list_sessions(self.manifests, request.after,
                                           request.limit or MAX_PAGE)
        return pb.ListSessionsReply(
            sessions=[pb.StoredSession(tenant=h.tenant, session_id=h.session_id,
                                       tokens=h.tokens, age_s=h.age_s) for h in held],
            next=cursor)

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseReply:
        self.pool_path.release(wire.lease_id_of(request))
        return wire.release_reply()

    async def FencePoolOp(
        self, request: pb.FencePoolOpRequest, context: grpc.aio.ServicerContext
    ) -> pb.FencePoolOpReply:
        try:
            await self.pool_path.fence(wire.op_id_of(request))
        except PoolError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return wire.fence_reply()

    async def SaveFromPool(
        self, request: pb.SaveFromPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveFromPoolReply:
        try:
            r = await self.pool_path.save(wire.save_from_pb(request))
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return wire.save_reply(r.chunks_written, r.chunks_skipped)


def _layer_of(key: str) -> int:
    """The layer a chunk key ends with (0 for a key that names none: the message still
    tells the caller it was not found)."""
    tail = key.rsplit("/", 1)[-1]
    if not (tail.isascii() and tail.isdigit()) or len(tail) > 5:
        return 0
    layer = int(tail)
    return layer if layer <= MAX_LAYER else 0


# Per call: keys named (each is a read or a delete: bound the work of one small request),
# and malformed chunks tolerated before a PutChunks stream is cut off.
MAX_KEYS_PER_CALL = 4096
MAX_REJECTED_PER_CALL = 64


async def _check_key_count(context: grpc.aio.ServicerContext, n: int) -> None:
    if n > MAX_KEYS_PER_CALL:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"at most {MAX_KEYS_PER_CALL} keys per call, got {n}")
