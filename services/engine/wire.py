"""Protos <-> engine dataclasses for the Engine service (``overture.v1.Engine``). The
engine's other proto edge is its kvstore client's, ``offload/kvstore_wire.py``."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc

from shared.proto import common_pb2, engine_pb2

from .api_types import (
    ChatMessage,
    EngineStatus,
    GenerateOutput,
    GenerateRequest,
    Guidance,
    PrefetchStats,
    RemapStatus,
    SamplingParams,
    TokenLogprob,
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
from .model.mapped import StoredTensor, StoredWeights
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
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,  # proto3 default 0 = off
        min_p=p.min_p,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_tokens=p.min_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else -1,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else -1,
    )


def _logprob_to_proto(t: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=t.token_id, token=t.text, bytes=t.raw, logprob=t.logprob,
        top=[common_pb2.TopLogprob(token_id=x.token_id, token=x.text, bytes=x.raw,
                                   logprob=x.logprob) for x in t.top])


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
        "device_only": r.device_only,
        "cache_retention_s": r.cache_retention_s,
        "node_admitted": r.node_admitted,
        # (its node manager, on this host, stamped when it sent it: the hop's time counts)
        "waited_s": r.waited_ms / 1000.0 + (
            min(60.0, max(0.0, time.time() - r.sent_us / 1e6)) if r.sent_us else 0.0),
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
        logprobs=[_logprob_to_proto(t) for t in o.logprobs],
        prompt_logprobs=[_logprob_to_proto(t) for t in o.prompt_logprobs],
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
        saved=[common_pb2.SessionSaved(tenant=e.session.tenant, session_id=e.session.session_id,
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
        remap=_remap_to_proto(s.remap),
    )


def _remap_to_proto(r: RemapStatus | None) -> engine_pb2.RemapCounters | None:
    if r is None:
        return None
    return engine_pb2.RemapCounters(
        alpha=r.alpha, node_layers=r.node_layers, slots=r.slots, lent_bytes=r.lent_bytes,
        node_lent_bytes=r.node_lent_bytes, lendable_layers=r.lendable_layers,
        layer_bytes=r.layer_bytes, remaps=r.remaps, reversions=r.reversions,
        transfers=r.transfers, transfer_s=r.transfer_s, step_transfer_s=r.step_transfer_s,
        stalled_forwards=r.stalled_forwards, give_way=r.give_way)


def _prefetch_to_proto(p: PrefetchStats | None) -> common_pb2.PrefetchCounters | None:
    if p is None:
        return None
    return common_pb2.PrefetchCounters(
        loaded_bytes=p.loaded_bytes, wasted_bytes=p.wasted_bytes,
        purged_blocks_by_layer=p.purged_blocks_by_layer, sessions=p.sessions,
        blocks_resident=p.blocks_resident)


def stored_weights(request: engine_pb2.ActivateRequest) -> StoredWeights | None:
    """Where the node's Reuse Store put the model's tensors (None: load privately)."""
    if not request.weights_arena:
        return None
    return StoredWeights(request.weights_arena, request.weights_arena_bytes,
                         request.weights_dtype,
                         tuple(StoredTensor(t.name, t.offset, t.nbytes, t.fill)
                               for t in request.stored))
