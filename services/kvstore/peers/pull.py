"""Pull a session from a peer kvstore: manifest first, then chunks lowest layer first.

Each chunk is verified (checksum) as it arrives and put into the local store, so layer 0 is
usable here while later layers are still on the wire.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from services.kvstore import wire
from services.kvstore.errors import ManifestIncomplete, TierUnavailable
from services.kvstore.manifests import Manifest, ManifestStore, manifest_key
from shared.chunk_codec import ChunkCorrupt, ChunkFormatError
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
    manifest: Manifest | None = None  # what was asked for (when found)


async def pull_session(
    manifests: ManifestStore,
    peer: str,
    tenant: str,
    session_id: str,
    first_layer: int = 0,
    window: int = 4,
    write_manifest: bool = False,
    timeout_s: float = 10.0,
    copy_of_shared: bool = False,
    wait_tokens: int = 0,
) -> PullResult:
    """Copy ``tenant/session_id`` from the kvstore at ``peer`` into ``manifests.store``.

    Raises ``ChunkFormatError`` for a malformed session reference (before any call) and
    ``TierUnavailable`` when the peer cannot be reached, sends a malformed manifest, or
    stays silent for ``timeout_s`` (for the manifest, or between two chunks). Corrupt
    chunks count as missing, and so does every chunk the manifest names that the stream
    did not deliver (it may end early, e.g. when the peer's session changed meanwhile).
    ``copy_of_shared``: the peer writes these chunks to the shared lowest tier itself, so
    they are kept in the local tiers only.
    With ``write_manifest`` the manifest is stored here once every chunk is durable
    locally (only if none was missing). ``wait_tokens``: the peer first waits (bounded)
    for its save of a turn that long (``GetManifest``).
    """
    manifest_key(tenant, session_id)  # the caller's input, checked before any call
    store = manifests.store
    async with insecure_channel(peer) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        try:
            reply = await stub.GetManifest(
                wire.session_ref(tenant, session_id, wait_tokens), timeout=timeout_s)
            found = wire.manifest_of_reply(reply)
            if found is None:
                return PullResult(False, detail="peer has no manifest for this session")
            manifest = _peer_manifest(found, tenant, session_id, peer)
            expected = {k for layer in range(first_layer, manifest.num_layers)
                        for k in manifest.layer_keys(layer)}
            result = PullResult(True)
            got: set[str] = set()
            call = stub.GetChunks(wire.chunks_request(tenant, session_id, first_layer, window))
            try:
                while True:
                    try:
                        raw = await asyncio.wait_for(call.read(), timeout_s)
                    except TimeoutError:
                        raise TierUnavailable(
                            f"peer {peer}: no chunk for {timeout_s:g} s mid-stream") from None
                    if raw is grpc.aio.EOF:
                        break
                    msg = wire.chunk_from_pb(raw)
                    if not msg.found:
                        continue  # counted below, with anything else not delivered
                    try:
                        receipt = await store.put_blob(msg.blob,
                                                       copy_of_shared=copy_of_shared)
                    except ChunkCorrupt as e:
                        log.warning("corrupt chunk %s from peer %s: %s", msg.key, peer, e)
                        store.metrics.checksum_failures.labels("peer").inc()
                        continue
                    got.add(receipt.key)  # the chunk's own key, whatever the message said
                    result.chunks += 1
                    result.bytes += len(msg.blob)
            finally:
                call.cancel()  # no-op once the stream ended
        except grpc.aio.AioRpcError as e:
            raise TierUnavailable(f"peer {peer}: {e.code().name}: {e.details()}") from None
    result.missing = len(expected - got)
    result.manifest = manifest
    if write_manifest and not result.missing and first_layer == 0:
        # put_manifest waits (bounded) for the write-behind of the chunks just stored.
        try:
            await manifests.put_manifest(manifest)
        except (ManifestIncomplete, TierUnavailable) as e:
            result.detail = f"manifest not written here: {e}"
    return result


def _peer_manifest(p: pb.SessionManifest, tenant: str, session_id: str, peer: str) -> Manifest:
    """The peer's manifest, refused (``TierUnavailable``: the peer's fault, not the
    caller's) if malformed or not the session asked for."""
    try:
        manifest = wire.manifest_from_pb(p)
    except ChunkFormatError as e:
        raise TierUnavailable(f"peer {peer} sent a malformed manifest: {e}") from None
    if (manifest.tenant, manifest.session_id) != (tenant, session_id):
        raise TierUnavailable(f"peer {peer} answered with the manifest of another session")
    return manifest
