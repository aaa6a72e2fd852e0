"""The KVStore gRPC servicer: a thin edge over ``TieredStore`` (protos stop here)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from services.kvstore.errors import ManifestIncomplete, StorageError, TierUnavailable
from services.kvstore.manifests import ManifestStore, manifest_key
from services.kvstore.peer import pull_session
from services.kvstore.pool.attach import PoolError
from services.kvstore.pool.data_path import EnginePoolPath
from services.kvstore.streaming import stream_session
from services.kvstore.wire import (
    geometry_from_pb,
    layer_to_pb,
    load_from_pb,
    lookup_from_pb,
    lookup_to_pb,
    manifest_from_pb,
    manifest_to_pb,
    save_from_pb,
    tier_to_pb,
)
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
    ) -> None:
        self.manifests = manifests
        self.store = manifests.store
        self.peer_timeout_s = peer_timeout_s
        self.pool_path = pool_path
        self.node_id = node_id
        self.window = window
        self.peer_address = peer_address

    async def Status(
        self, request: pb.KVStoreStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVStoreStatus:
        healthy, detail = self.store.health()
        m = self.store.metrics
        failures = sum(
            m.value("kvstore_checksum_failures_total", tier=t)
            for t in [*(x.name for x in self.store.tiers), "peer"]
        )
        return pb.KVStoreStatus(
            node_id=self.node_id,
            healthy=healthy,
            detail=detail,
            tiers=[tier_to_pb(s) for s in self.store.stats()],
            write_queue_depth=self.store.writer.depth,
            dropped_writes=self.store.writer.dropped,
            checksum_failures=int(failures),
        )

    async def GetChunks(
        self, request: pb.GetChunksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChunkData]:
        # The client may ask for less read-ahead than the configured bound, never more:
        # each chunk in flight is a blob held in memory.
        window = min(request.window or self.window, self.window)
        if request.keys:
            await _check_key_count(context, len(request.keys))
            for i, key in enumerate(request.keys):
                blob = await self.store.get_blob(key)
                yield _chunk_msg(key, blob, layer=_layer_of(key), index=i)
            return
        try:
            manifest = await self.manifests.get_manifest(
                request.session.tenant, request.session.session_id
            )
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        if manifest is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no manifest for this session")
            return
        last = request.last_layer if request.has_last_layer else None
        if request.first_layer >= manifest.num_layers or (
                last is not None and not request.first_layer <= last < manifest.num_layers):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"layers [{request.first_layer}, {last}] are not within the session's "
                f"{manifest.num_layers} layers (first <= last required)")
        stream = stream_session(self.store, manifest, request.first_layer, last, window)
        async for layer, index, key, blob in stream:
            # grpc's write awaits HTTP/2 flow control, so the read-ahead stays bounded.
            yield _chunk_msg(key, blob, layer, index)

    async def PutChunks(
        self, request_iterator: AsyncIterator[pb.ChunkData], context: grpc.aio.ServicerContext
    ) -> pb.PutChunksReply:
        stored = rejected = 0
        wait = False
        receipts = []
        detail = ""
        async for msg in request_iterator:
            wait = wait or msg.wait_durable
            try:
                receipts.append(
                    await self.store.put_blob(msg.blob, msg.priority if msg.has_priority else None)
                )
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
        return pb.PutChunksReply(
            stored=stored, rejected=rejected, not_durable=not_durable, detail=detail
        )

    async def GetManifest(
        self, request: pb.ManifestRef, context: grpc.aio.ServicerContext
    ) -> pb.ManifestReply:
        try:
            m = await self.manifests.get_manifest(request.tenant, request.session_id)
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if m is None:
            return pb.ManifestReply(found=False)
        return pb.ManifestReply(found=True, manifest=manifest_to_pb(m))

    async def PutManifest(
        self, request: pb.SessionManifest, context: grpc.aio.ServicerContext
    ) -> pb.PutManifestReply:
        try:
            await self.manifests.put_manifest(manifest_from_pb(request))
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (ManifestIncomplete, TierUnavailable) as e:
            return pb.PutManifestReply(written=False, detail=str(e))
        return pb.PutManifestReply(written=True, detail="ok")

    async def Stat(
        self, request: pb.StatRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatReply:
        await _check_key_count(context, len(request.keys))
        out = [pb.KeyLocation(key=k, tiers=await self.store.locate(k)) for k in request.keys]
        return pb.StatReply(keys=out)

    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteReply:
        tiers = list(request.tiers)
        try:
            self.store.check_tier_names(tiers)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await _check_key_count(context, len(request.keys))
        if request.session.session_id:
            try:  # before anything is done with the names
                manifest_key(request.session.tenant, request.session.session_id)
            except ChunkFormatError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        everywhere = not tiers or self.store.lowest.name in tiers
        n = 0
        for k in request.keys:
            n += await self.store.delete(k, tiers)
        if request.session.session_id:
            tenant, sid = request.session.tenant, request.session.session_id
            if everywhere:  # the session is gone, not just evicted from faster tiers
                await self.manifests.forget(tenant, sid)
            try:
                m = await self.manifests.get_manifest(tenant, sid)
                if m is not None and request.with_chunks:
                    for k in m.chunk_keys():
                        n += await self.store.delete(k, tiers)
                n += await self.manifests.delete_manifest(tenant, sid, tiers)
            except ChunkFormatError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.DeleteReply(deleted=n)

    async def PullSession(
        self, request: pb.PullSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.PullSessionReply:
        peer = request.peer_address or self.peer_address
        if not peer:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "no peer_address given and kvstore.peer_address is empty",
            )
        try:
            r = await pull_session(
                self.manifests,
                peer,
                request.session.tenant,
                request.session.session_id,
                request.first_layer,
                self.window,
                write_manifest=request.wait_durable,
                timeout_s=self.peer_timeout_s,
            )
        except TierUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ChunkFormatError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.PullSessionReply(
            found=r.found, chunks=r.chunks, missing=r.missing, bytes=r.bytes, detail=r.detail
        )

    # ------------------------------------------------ same-node data path (pool/)

    async def AttachPool(
        self, request: pb.AttachPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttachPoolReply:
        try:
            pool_id, bpc = await self.pool_path.attach(geometry_from_pb(request.pool))
        except ConfigError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (PoolError, ImportError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AttachPoolReply(pool_id=pool_id, blocks_per_chunk=bpc)

    async def LookupPrefix(
        self, request: pb.LookupPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupPrefixReply:
        try:
            result = await self.pool_path.lookup(lookup_from_pb(request))
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if result.lease_id:
            # A caller gone before the reply never learns the lease id: end the lease here
            # rather than let it pin chunks until it expires. Past the caller's deadline
            # (which the server sees as time run out, not as a cancellation) the reply
            # cannot arrive; a disconnect shows as a cancelled call once it is over.
            lease_id = result.lease_id
            left = context.time_remaining()
            if left is not None and left <= 0:
                self.pool_path.release(lease_id)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "lookup past its deadline")
            context.add_done_callback(
                lambda ctx: self.pool_path.release(lease_id) if ctx.cancelled() else None)
        return lookup_to_pb(result)

    async def LoadIntoPool(
        self, request: pb.LoadIntoPoolRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LayerLoaded]:
        try:
            # aclosing: a dropped call finishes the load's clean-up before it ends (see
            # EnginePoolPath.load): no pool write after the RPC.
            async with contextlib.aclosing(self.pool_path.load(load_from_pb(request))) as layers:
                async for msg in layers:
                    yield layer_to_pb(msg)
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseReply:
        self.pool_path.release(request.lease_id)
        return pb.ReleaseLeaseReply()

    async def FencePoolOp(
        self, request: pb.FencePoolOpRequest, context: grpc.aio.ServicerContext
    ) -> pb.FencePoolOpReply:
        try:
            await self.pool_path.fence(request.op_id)
        except PoolError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.FencePoolOpReply()

    async def SaveFromPool(
        self, request: pb.SaveFromPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveFromPoolReply:
        try:
            r = await self.pool_path.save(save_from_pb(request))
        except (PoolError, ChunkFormatError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.SaveFromPoolReply(
            chunks_written=r.chunks_written, chunks_skipped=r.chunks_skipped
        )


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


def _chunk_msg(key: str, blob: bytes | bytearray | None, layer: int, index: int) -> pb.ChunkData:
    if blob is None:
        return pb.ChunkData(key=key, found=False, layer=layer, index=index)
    return pb.ChunkData(key=key, blob=bytes(blob), found=True, layer=layer, index=index)
