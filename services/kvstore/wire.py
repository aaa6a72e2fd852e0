"""Proto <-> dataclass conversions of the KVStore service and of its peer client: the only
module of the kvstore that builds or reads protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass

from services.kvstore.engine_path.attach import PoolGeometry
from services.kvstore.engine_path.types import (
    FindRequest,
    FoundOnPeer,
    LayerLoaded,
    LoadRequest,
    LookupRequest,
    PeerChunk,
    SaveRequest,
)
from services.kvstore.manifests.manifest import Manifest, scoped_session
from services.kvstore.tiers.base import TierStats
from shared.kv_layout import KVSpan, StoredPrefix
from shared.proto import kvstore_pb2 as pb
from shared.session_key import SessionKey


def manifest_to_pb(m: Manifest) -> pb.SessionManifest:
    return pb.SessionManifest(
        tenant=m.tenant,
        session_id=m.session_id,
        model_fp=m.model_fp,
        block_hashes=list(m.block_hashes),
        token_count=m.token_count,
        num_layers=m.num_layers,
        blocks_per_chunk=m.blocks_per_chunk,
        updated=m.updated,
        retain_s=m.retain_s,
    )


def manifest_from_pb(p: pb.SessionManifest) -> Manifest:
    """Raises ``ChunkFormatError`` (a ValueError) on invalid fields."""
    return Manifest(
        tenant=p.tenant,
        session_id=p.session_id,
        model_fp=p.model_fp,
        block_hashes=tuple(bytes(h) for h in p.block_hashes),
        token_count=p.token_count,
        num_layers=p.num_layers,
        blocks_per_chunk=p.blocks_per_chunk,
        updated=p.updated,
        retain_s=p.retain_s,
    )


def tier_to_pb(s: TierStats) -> pb.TierStatus:
    return pb.TierStatus(
        name=s.name,
        entries=s.entries,
        bytes_used=s.bytes_used,
        capacity_bytes=s.capacity_bytes,
        healthy=s.healthy,
        detail=s.detail,
    )


# ---------------------------------------------------------------- pool data path


def geometry_from_pb(p: pb.PoolGeometry) -> PoolGeometry:
    return PoolGeometry(
        pool_name=p.pool_name,
        device=p.device or "cpu",
        num_blocks=p.num_blocks,
        block_size=p.block_size,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        dtype=p.dtype,
        num_layers=p.num_layers,
        model_fp=p.model_fp,
    )


def span_to_pb(s: KVSpan) -> pb.PrefixSpan:
    return pb.PrefixSpan(
        chunk_hash=s.chunk_hash, first_block=s.first_block, use_blocks=s.use_blocks,
        tier=s.tier, bytes=s.nbytes,
    )


def span_from_pb(p: pb.PrefixSpan) -> KVSpan:
    return KVSpan(bytes(p.chunk_hash), p.first_block, p.use_blocks, p.tier, p.bytes)


def lookup_from_pb(p: pb.LookupPrefixRequest) -> LookupRequest:
    return LookupRequest(
        tenant=p.tenant,
        session_id=p.session_id,
        model_fp=p.model_fp,
        block_hashes=tuple(bytes(h) for h in p.block_hashes),
        first_block=p.first_block,
        num_layers=p.num_layers,
        peer_address=p.peer_address,
        peer_wait_tokens=p.peer_wait_tokens,
        whole_session=p.whole_session,
    )


def lookup_to_pb(r: StoredPrefix) -> pb.LookupPrefixReply:
    return pb.LookupPrefixReply(
        matched_blocks=r.matched_blocks,
        spans=[span_to_pb(s) for s in r.spans],
        lease_id=r.lease_id,
        tier_bytes_per_s=r.tier_bytes_per_s,
        block_hashes=list(r.block_hashes),
    )


def load_from_pb(p: pb.LoadIntoPoolRequest) -> LoadRequest:
    return LoadRequest(
        pool_id=p.pool_id,
        lease_id=p.lease_id,
        tenant=p.tenant,
        model_fp=p.model_fp,
        spans=tuple(span_from_pb(s) for s in p.spans),
        block_ids=tuple(p.block_ids),
        num_layers=p.num_layers,
        op_id=p.op_id,
    )


def layer_to_pb(x: LayerLoaded) -> pb.LayerLoaded:
    return pb.LayerLoaded(layer=x.layer, ok=x.ok, error=x.error)


def save_from_pb(p: pb.SaveFromPoolRequest) -> SaveRequest:
    return SaveRequest(
        pool_id=p.pool_id,
        tenant=p.tenant,
        session_id=p.session_id,
        model_fp=p.model_fp,
        block_hashes=tuple(bytes(h) for h in p.block_hashes),
        token_count=p.token_count,
        first_block=p.first_block,
        block_ids=tuple(p.block_ids),
        num_layers=p.num_layers,
        op_id=p.op_id,
        retain_s=p.retain_s,
    )


def save_reply(chunks_written: int, chunks_skipped: int) -> pb.SaveFromPoolReply:
    return pb.SaveFromPoolReply(chunks_written=chunks_written, chunks_skipped=chunks_skipped)


def attach_reply(pool_id: str, blocks_per_chunk: int) -> pb.AttachPoolReply:
    return pb.AttachPoolReply(pool_id=pool_id, blocks_per_chunk=blocks_per_chunk)


def release_reply() -> pb.ReleaseLeaseReply:
    return pb.ReleaseLeaseReply()


def fence_reply() -> pb.FencePoolOpReply:
    return pb.FencePoolOpReply()


# ---------------------------------------------------------------- chunks and sessions


@dataclass(frozen=True)
class ChunksQuery:
    """GetChunks: the named ``keys``, or else the session's layers from ``first_layer``
    to ``last_layer`` (None = the last)."""

    keys: tuple[str, ...]
    tenant: str
    session_id: str
    window: int
    first_layer: int
    last_layer: int | None


def chunks_query(p: pb.GetChunksRequest) -> ChunksQuery:
    return ChunksQuery(tuple(p.keys), *session_of(p.session), p.window,
                       p.first_layer, p.last_layer if p.has_last_layer else None)


def chunks_request(tenant: str, session_id: str, first_layer: int, window: int
                   ) -> pb.GetChunksRequest:
    return pb.GetChunksRequest(session=session_ref(tenant, session_id),
                               first_layer=first_layer, window=window)


# ---- FindPrefix (node to node)

def find_request(r: FindRequest) -> pb.FindPrefixRequest:
    return pb.FindPrefixRequest(
        tenant=r.tenant, session_id=r.session_id, model_fp=r.model_fp,
        block_hashes=list(r.block_hashes), first_block=r.first_block,
        num_layers=r.num_layers, blocks_per_chunk=r.blocks_per_chunk,
        wait_tokens=r.wait_tokens,
    )


def find_from_pb(p: pb.FindPrefixRequest) -> FindRequest:
    return FindRequest(
        tenant=p.tenant, session_id=p.session_id, model_fp=p.model_fp,
        block_hashes=tuple(bytes(h) for h in p.block_hashes), first_block=p.first_block,
        num_layers=p.num_layers, blocks_per_chunk=p.blocks_per_chunk,
        wait_tokens=p.wait_tokens,
    )


def find_reply(r: FoundOnPeer) -> pb.FindPrefixReply:
    return pb.FindPrefixReply(
        matched_blocks=r.matched_blocks, lease_id=r.lease_id, waited_s=r.waited_s,
        data_port=r.data_port,
        chunks=[pb.PeerChunk(chunk_hashes=list(c.chunk_hashes), first_block=c.first_block,
                             use_blocks=c.use_blocks, tier=c.tier) for c in r.chunks],
    )


def found_from_pb(p: pb.FindPrefixReply) -> FoundOnPeer:
    return FoundOnPeer(
        matched_blocks=p.matched_blocks, lease_id=p.lease_id, waited_s=p.waited_s,
        data_port=p.data_port,
        chunks=tuple(PeerChunk(tuple(bytes(h) for h in c.chunk_hashes), c.first_block,
                               c.use_blocks, c.tier) for c in p.chunks),
    )


@dataclass(frozen=True)
class ChunkMessage:
    """One chunk of a GetChunks or PutChunks stream."""

    key: str
    blob: bytes
    found: bool
    layer: int = 0
    index: int = 0
    priority: int | None = None  # PutChunks: None = the store's default
    wait_durable: bool = False  # PutChunks: answer once the chunks are durable


def chunk_to_pb(key: str, blob: bytes | bytearray | None, layer: int, index: int
                ) -> pb.ChunkData:
    if blob is None:
        return pb.ChunkData(key=key, found=False, layer=layer, index=index)
    return pb.ChunkData(key=key, blob=bytes(blob), found=True, layer=layer, index=index)


def chunk_from_pb(p: pb.ChunkData) -> ChunkMessage:
    return ChunkMessage(p.key, p.blob, p.found, p.layer, p.index,
                        p.priority if p.has_priority else None, p.wait_durable)


def put_chunks_reply(stored: int, rejected: int, not_durable: int, detail: str
                     ) -> pb.PutChunksReply:
    return pb.PutChunksReply(stored=stored, rejected=rejected, not_durable=not_durable,
                             detail=detail)


def session_ref(tenant: str, session_id: str, wait_tokens: int = 0) -> pb.ManifestRef:
    return pb.ManifestRef(tenant=tenant, session_id=session_id, wait_tokens=wait_tokens)


def session_of(p: pb.ManifestRef) -> SessionKey:
    """(tenant, the session's name here): scoped by ``model_fp`` when the caller names the
    model (a peer names a session by the name this kvstore gave it)."""
    return SessionKey(p.tenant, scoped_session(p.session_id, p.model_fp))


def manifest_reply(m: Manifest | None) -> pb.ManifestReply:
    if m is None:
        return pb.ManifestReply(found=False)
    return pb.ManifestReply(found=True, manifest=manifest_to_pb(m))


def manifest_of_reply(p: pb.ManifestReply) -> pb.SessionManifest | None:
    """The manifest message of a GetManifest reply (None: not found); ``manifest_from_pb``
    checks it."""
    return p.manifest if p.found else None


def put_manifest_reply(written: bool, detail: str) -> pb.PutManifestReply:
    return pb.PutManifestReply(written=written, detail=detail)


def keys_of(p: pb.StatRequest) -> tuple[str, ...]:
    return tuple(p.keys)


def stat_reply(locations: list[tuple[str, list[str]]]) -> pb.StatReply:
    return pb.StatReply(keys=[pb.KeyLocation(key=k, tiers=t) for k, t in locations])


@dataclass(frozen=True)
class DeleteQuery:
    keys: tuple[str, ...]
    tiers: tuple[str, ...]  # empty = every tier
    tenant: str
    session_id: str  # "" = no session
    with_chunks: bool


def delete_query(p: pb.DeleteRequest) -> DeleteQuery:
    return DeleteQuery(tuple(p.keys), tuple(p.tiers), *session_of(p.session),
                       p.with_chunks)


def delete_reply(deleted: int) -> pb.DeleteReply:
    return pb.DeleteReply(deleted=deleted)


@dataclass(frozen=True)
class PullQuery:
    peer_address: str  # "" = the configured peer
    tenant: str
    session_id: str
    first_layer: int
    wait_durable: bool


def pull_query(p: pb.PullSessionRequest) -> PullQuery:
    return PullQuery(p.peer_address, p.session.tenant, p.session.session_id, p.first_layer,
                     p.wait_durable)


def pull_reply(found: bool, chunks: int, missing: int, nbytes: int, detail: str
               ) -> pb.PullSessionReply:
    return pb.PullSessionReply(found=found, chunks=chunks, missing=missing, bytes=nbytes,
                               detail=detail)


def status_reply(node_id: str, healthy: bool, detail: str, tiers: list[TierStats],
                 write_queue_depth: int, dropped_writes: int, checksum_failures: int
                 ) -> pb.KVStoreStatus:
    return pb.KVStoreStatus(
        node_id=node_id, healthy=healthy, detail=detail, tiers=[tier_to_pb(t) for t in tiers],
        write_queue_depth=write_queue_depth, dropped_writes=dropped_writes,
        checksum_failures=checksum_failures,
    )


def release_request(lease_id: str) -> pb.ReleaseLeaseRequest:
    return pb.ReleaseLeaseRequest(lease_id=lease_id)


def lease_id_of(p: pb.ReleaseLeaseRequest) -> str:
    return p.lease_id


def op_id_of(p: pb.FencePoolOpRequest) -> str:
    return p.op_id
