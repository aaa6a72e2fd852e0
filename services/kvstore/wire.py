"""Proto <-> dataclass conversions of the KVStore service (the only place that does it)."""

from __future__ import annotations

from services.kvstore.manifests.manifest import Manifest
from services.kvstore.pool.attach import PoolGeometry
from services.kvstore.pool.types import (
    LayerLoaded,
    LoadRequest,
    LookupRequest,
    LookupResult,
    SaveRequest,
)
from services.kvstore.tiers.base import TierStats
from shared.kv_layout import KVSpan
from shared.proto import kvstore_pb2 as pb


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
    )


def lookup_to_pb(r: LookupResult) -> pb.LookupPrefixReply:
    return pb.LookupPrefixReply(
        matched_blocks=r.matched_blocks,
        spans=[span_to_pb(s) for s in r.spans],
        lease_id=r.lease_id,
        tier_bytes_per_s=r.tier_bytes_per_s,
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
    )
