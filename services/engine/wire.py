"""Protos <-> engine dataclasses. The only module of the engine that touches protos."""

from __future__ import annotations

import json
from typing import Any

import grpc

from shared.kv_layout import KVSpan, StoredPrefix
from shared.proto import common_pb2, engine_pb2, kvstore_pb2

from .api_types import (
    ChatMessage,
    EngineStatus,
    GenerateOutput,
    GenerateRequest,
    Guidance,
    PrefetchStats,
    SamplingParams,
    ToolCall,
)
from .errors import (
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    EngineError,
)
from .offload.jobs import LoadJob, PoolGeometry, SaveJob
from .offload.save_log import SavedSession

STATUS_CODES = {
    INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    INTERNAL: grpc.StatusCode.INTERNAL,
    UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0 else 1.0,  # proto3 default 0 means "not set" = off
        top_k=p.top_k,
        max_tokens=p.max_tokens,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def request_from_proto(r: common_pb2.GenerateRequest) -> GenerateRequest:
    kind = r.input_kind
    base: dict[str, Any] = {
        "request_id": r.request_id,
        "sampling": sampling_from_proto(r.sampling),
        "model": r.model,
        "session_id": r.session_id,
        "tenant": r.tenant,
        "priority": r.priority,
        "add_generation_prompt": r.add_generation_prompt,
        "kv_source": r.kv_source,
        "kv_source_tokens": r.kv_source_tokens,
        "no_reuse": r.no_reuse,
        "node_admitted": r.node_admitted,
        "guidance": guidance_from_proto(r.guidance),
    }
    if kind == common_pb2.GenerateRequest.CHAT:
        msgs = tuple(
            ChatMessage(m.role, m.content,
                        tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                        m.tool_call_id, m.name)
            for m in r.messages)
        return GenerateRequest(messages=msgs, **base)
    if kind == common_pb2.GenerateRequest.TOKEN_IDS:
        return GenerateRequest(prompt_token_ids=tuple(r.prompt_token_ids), **base)
    return GenerateRequest(prompt=r.prompt, **base)


def guidance_from_proto(g: common_pb2.Guidance) -> Guidance:
    """The scheduler sends checked JSON; a malformed field is a bad request all the same."""
    try:
        tools = tuple(json.loads(g.tools_json)) if g.tools_json else ()
        schema = json.loads(g.json_schema) if g.json_schema else None
    except ValueError as e:
        raise EngineError(INVALID_ARGUMENT, f"guidance: malformed JSON: {e}") from None
    return Guidance(
        tools=tools,
        tool_choice=g.tool_choice or "auto",
        parallel_tool_calls=g.parallel_tool_calls,
        response_format=g.response_format,
        json_schema=schema,
    )


def chunk_to_proto(o: GenerateOutput) -> common_pb2.GenerateChunk:
    return common_pb2.GenerateChunk(
        request_id=o.request_id,
        text=o.text,
        token_ids=list(o.token_ids),
        prompt_token_ids=list(o.prompt_token_ids),
        prompt_tokens=o.prompt_tokens,
        completion_tokens=o.completion_tokens,
        finish_reason=o.finish_reason or "",
        cached_tokens=o.cached_tokens,
        kv_from=o.kv_from,
        tool_calls=[common_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name,
                                             arguments=c.arguments) for c in o.tool_calls],
    )


def dropped_reply(blocks: int) -> engine_pb2.DropDeviceCacheReply:
    return engine_pb2.DropDeviceCacheReply(blocks_dropped=blocks)


def saved_after(r: engine_pb2.EngineStatusRequest) -> int:
    return r.saved_after


def status_to_proto(
    s: EngineStatus, saved: tuple[SavedSession, ...] = (), now: float = 0.0
) -> engine_pb2.EngineStatus:
    """``now``: ``time.monotonic()`` when answering (the ages are counted to it)."""
    return engine_pb2.EngineStatus(
        queue_delay_s=max(0.0, now - s.oldest_waiting_since) if s.oldest_waiting_since else 0.0,
        step_running_s=max(0.0, now - s.step_started) if s.step_started else 0.0,
        saved=[common_pb2.SessionSaved(tenant=e.tenant, session_id=e.session_id,
                                       tokens=e.tokens, seq=e.seq) for e in saved],
        models=[m.to_proto() for m in s.models],
        blocks_total=s.blocks_total,
        blocks_free=s.blocks_free,
        blocks_used=s.blocks_used,
        blocks_evictable=s.blocks_evictable,
        blocks_committed=s.blocks_committed,
        running=s.running,
        waiting=s.waiting,
        device_budget_bytes=s.device_budget_bytes,
        block_bytes=s.block_bytes,
        device=s.device,
        prefetch=_prefetch_to_proto(s.reuse.prefetch),
    )


def _prefetch_to_proto(p: PrefetchStats | None) -> common_pb2.PrefetchCounters | None:
    if p is None:
        return None
    return common_pb2.PrefetchCounters(
        loaded_bytes=p.loaded_bytes, wasted_bytes=p.wasted_bytes,
        purged_blocks_by_layer=p.purged_blocks_by_layer, sessions=p.sessions,
        blocks_resident=p.blocks_resident)


# ---- the node's kvstore (same-node pool data path) ----------------------------------------

# The kvstore names chunks tenant/...: requests without a tenant use this one.
DEFAULT_TENANT = "default"


def kvstore_tenant(tenant: str) -> str:
    return tenant or DEFAULT_TENANT


# ---- the engine's kvstore client (offload/kvstore_client.py) -------------------------


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
    tenant: str, session_id: str, model_fp: str, hashes: list[bytes], first_block: int,
    num_layers: int, peer: str = "", peer_tokens: int = 0, whole_session: bool = False,
) -> kvstore_pb2.LookupPrefixRequest:
    return kvstore_pb2.LookupPrefixRequest(
        tenant=kvstore_tenant(tenant), session_id=session_id, model_fp=model_fp,
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
        pool_id=pool_id, tenant=kvstore_tenant(job.tenant), session_id=job.session_id,
        model_fp=model_fp,
        block_hashes=list(job.block_hashes), token_count=job.token_count,
        first_block=job.first_block, block_ids=list(job.block_ids), num_layers=num_layers,
        op_id=op_id,
    )
