"""Protos <-> the offload's plain data for the node's kvstore (``overture.v1.KVStore``): the
one module of the offload that touches protos (the Engine service's are in ``wire.py``).
"""

from __future__ import annotations

from services.engine.offload.jobs import LoadJob, PoolGeometry, SaveJob
from shared.kv_layout import KVSpan, StoredPrefix
from shared.proto import kvstore_pb2
from shared.session_key import SessionKey

# The kvstore names chunks tenant/...: requests without a tenant use this one.
DEFAULT_TENANT = "default"


def kvstore_tenant(tenant: str) -> str:
    return tenant or DEFAULT_TENANT


def attach_request(g: PoolGeometry) -> kvstore_pb2.AttachPoolRequest:
    return kvstore_pb2.AttachPoolRequest(pool=kvstore_pb2.PoolGeometry(
        pool_name=g.pool_name, device=g.device, num_blocks=g.num_blocks,
        block_size=g.block_size, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
        dtype=g.dtype, num_layers=g.num_layers, model_fp=g.model_fp,
    ))


def attach_reply(reply: kvstore_pb2.AttachPoolReply) -> tuple[str, int]:
    """(pool_id, blocks_per_chunk)."""
    return reply.pool_id, reply.blocks_per_chunk or 1


def lookup_request(
    session: SessionKey, model_fp: str, hashes: list[bytes], first_block: int,
    num_layers: int, peer: str = "", peer_tokens: int = 0, whole_session: bool = False,
) -> kvstore_pb2.LookupPrefixRequest:
    return kvstore_pb2.LookupPrefixRequest(
        tenant=kvstore_tenant(session.tenant), session_id=session.session_id, model_fp=model_fp,
        block_hashes=hashes, first_block=first_block, num_layers=num_layers,
        peer_address=peer, peer_wait_tokens=peer_tokens, whole_session=whole_session,
    )


def lookup_answer(reply: kvstore_pb2.LookupPrefixReply) -> StoredPrefix:
    spans = [KVSpan(bytes(s.chunk_hash), s.first_block, s.use_blocks, s.tier, s.bytes)
             for s in reply.spans]
    return StoredPrefix(reply.matched_blocks, spans, reply.lease_id,
                        dict(reply.tier_bytes_per_s),
                        tuple(bytes(h) for h in reply.block_hashes))


def release_request(lease_id: str) -> kvstore_pb2.ReleaseLeaseRequest:
    return kvstore_pb2.ReleaseLeaseRequest(lease_id=lease_id)


def fence_request(op_id: str) -> kvstore_pb2.FencePoolOpRequest:
    return kvstore_pb2.FencePoolOpRequest(op_id=op_id)


def layer_loaded(msg: kvstore_pb2.LayerLoaded) -> tuple[int, bool, str]:
    """(layer, ok, error) of one LoadIntoPool reply."""
    return msg.layer, msg.ok, msg.error


def chunks_written(reply: kvstore_pb2.SaveFromPoolReply) -> int:
    return reply.chunks_written


def span_to_proto(s: KVSpan) -> kvstore_pb2.PrefixSpan:
    return kvstore_pb2.PrefixSpan(
        chunk_hash=s.chunk_hash, first_block=s.first_block, use_blocks=s.use_blocks,
        tier=s.tier, bytes=s.nbytes,
    )


def load_to_proto(
    job: LoadJob, pool_id: str, model_fp: str, num_layers: int, op_id: str = ""
) -> kvstore_pb2.LoadIntoPoolRequest:
    return kvstore_pb2.LoadIntoPoolRequest(
        pool_id=pool_id, lease_id=job.plan.lease_id, tenant=kvstore_tenant(job.tenant),
        model_fp=model_fp,
        spans=[span_to_proto(s) for s in job.plan.spans], block_ids=list(job.block_ids),
        num_layers=num_layers, op_id=op_id,
    )


def save_to_proto(
    job: SaveJob, pool_id: str, model_fp: str, num_layers: int, op_id: str = ""
) -> kvstore_pb2.SaveFromPoolRequest:
    return kvstore_pb2.SaveFromPoolRequest(
        pool_id=pool_id, tenant=kvstore_tenant(job.session.tenant),
        session_id=job.session.session_id,
        model_fp=model_fp,
        block_hashes=list(job.block_hashes), token_count=job.token_count,
        first_block=job.first_block, block_ids=list(job.block_ids), num_layers=num_layers,
        op_id=op_id, retain_s=job.retain_s,
    )
