"""Pull a session from a peer kvstore: manifest first, then chunks lowest layer first.

Each chunk is verified (checksum) as it arrives and put into the local store, so layer 0 is
usable here while later layers are still on the wire.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from services.kvstore.errors import ManifestIncomplete, TierUnavailable
from services.kvstore.store import TieredStore
from services.kvstore.wire import manifest_from_pb
from shared.chunk_codec import ChunkCorrupt
from shared.grpc_server import insecure_channel
from shared.proto import kvstore_pb2 as pb
from shared.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class PullResult:
    found: bool
    chunks: int = 0
    missing: int = 0
    bytes: int = 0
    detail: str = ""


async def pull_session(
    store: TieredStore,
    peer: str,
    tenant: str,
    session_id: str,
    first_layer: int = 0,
    window: int = 4,
    write_manifest: bool = False,
) -> PullResult:
    """Copy ``tenant/session_id`` from the kvstore at ``peer`` into ``store``.

    Raises ``TierUnavailable`` when the peer cannot be reached. Corrupt chunks count as
    missing. With ``write_manifest`` the manifest is stored here once every chunk is
    durable locally (only if none was missing).
    """
    async with insecure_channel(peer) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        ref = pb.ManifestRef(tenant=tenant, session_id=session_id)
        try:
            reply = await stub.GetManifest(ref)
            if not reply.found:
                return PullResult(False, detail="peer has no manifest for this session")
            manifest = manifest_from_pb(reply.manifest)
            result = PullResult(True)
            req = pb.GetChunksRequest(session=ref, first_layer=first_layer, window=window)
            async for msg in stub.GetChunks(req):
                if not msg.found:
                    result.missing += 1
                    continue
                try:
                    await store.put_blob(msg.blob)
                except ChunkCorrupt as e:
                    log.warning("corrupt chunk %s from peer %s: %s", msg.key, peer, e)
                    store.metrics.checksum_failures.labels("peer").inc()
                    result.missing += 1
                    continue
                result.chunks += 1
                result.bytes += len(msg.blob)
        except grpc.aio.AioRpcError as e:
            raise TierUnavailable(f"peer {peer}: {e.code().name}: {e.details()}") from None
    if write_manifest and not result.missing and first_layer == 0:
        # put_manifest waits (bounded) for the write-behind of the chunks just stored.
        try:
            await store.put_manifest(manifest)
        except (ManifestIncomplete, TierUnavailable) as e:
            result.detail = f"manifest not written here: {e}"
    return result
