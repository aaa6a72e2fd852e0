"""Proto <-> dataclass conversions of the KVStore service (the only place that does it)."""

from __future__ import annotations

from services.kvstore.manifest import Manifest
from services.kvstore.tiers.base import TierStats
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
