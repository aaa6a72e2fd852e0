"""Protobuf <-> dataclass conversion for the scheduler (the only module that touches protos
besides the gRPC edges)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.api import (
    ApiRequest,
    Choice,
    Chunk,
    Guidance,
    Message,
    TokenLogprob,
    ToolCallOut,
)
from services.scheduler.cluster import Load, ModelSpec, NodeInfo
from shared.proto import common_pb2, scheduler_pb2

GenerateProto = common_pb2.GenerateRequest  # what run_choices hands the dispatcher


def node_info(msg: scheduler_pb2.RegisterNodeRequest) -> NodeInfo:
    return NodeInfo(
        node_id=msg.node_id,
        address=msg.address,
        models=tuple(
            ModelSpec(m.name, m.fingerprint, m.max_model_len, m.dtype, m.max_num_seqs)
            for m in msg.models
        ),
        kvstore_address=msg.kvstore_address,
        metrics=tuple(sorted(msg.metrics.items())),
    )


def load(msg: scheduler_pb2.HeartbeatMsg) -> Load:
    return Load(
        running=msg.running,
        waiting=msg.waiting,
        in_flight=msg.in_flight,
        blocks_free=msg.blocks_free,
        blocks_total=msg.blocks_total,
        problem=msg.problem,
        degraded=msg.degraded,
        queue_delay_s=msg.queue_delay_s,
        prefetch_loaded_bytes=msg.prefetch.loaded_bytes,
        prefetch_wasted_bytes=msg.prefetch.wasted_bytes,
        prefetch_purged_by_layer=tuple(msg.prefetch.purged_blocks_by_layer),
        prefetch_sessions=msg.prefetch.sessions,
        device_budget_bytes=msg.device_budget_bytes,
    )


def chunk(msg: common_pb2.GenerateChunk, node: str = "") -> Chunk:
    return Chunk(
        kv_from=msg.kv_from,
        node=node,
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        prompt_token_ids=tuple(msg.prompt_token_ids),
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        finish_reason=msg.finish_reason,
        cached_tokens=msg.cached_tokens,
        tool_calls=tuple(ToolCallOut(c.index, c.id, c.name, c.arguments)
                         for c in msg.tool_calls),
        logprobs=tuple(_logprob(t) for t in msg.logprobs),
        prompt_logprobs=tuple(_logprob(t) for t in msg.prompt_logprobs),
    )


def _logprob(t: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(t.token, t.bytes, t.logprob if t.HasField("logprob") else None,
                        tuple((x.token, x.bytes, x.logprob) for x in t.top))


_KINDS = {
    "chat": common_pb2.GenerateRequest.CHAT,
    "text": common_pb2.GenerateRequest.PROMPT,
    "tokens": common_pb2.GenerateRequest.TOKEN_IDS,
}


def generate_request(
    req: ApiRequest, choice: Choice, model: str, request_id: str
) -> common_pb2.GenerateRequest:
    s = req.sampling
    sampling = common_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
    )
    if choice.seed is not None:
        sampling.seed = choice.seed
    if s.logprobs >= 0:
        sampling.logprobs = s.logprobs
    if s.echo:  # the prompt's tokens spell its text too (a token-id prompt has no other)
        sampling.prompt_logprobs = max(s.logprobs, 0)
    p = choice.prompt
    return common_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        session_id=req.session_id,
        tenant=req.tenant,
        input_kind=_KINDS[p.kind],
        prompt=p.text,
        messages=[_message(m) for m in p.messages],
        prompt_token_ids=list(p.token_ids),
        sampling=sampling,
        priority=req.priority,
        add_generation_prompt=req.add_generation_prompt,
        guidance=_guidance(req.guidance),
    )


def _message(m: Message) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        role=m.role, content=m.content, tool_call_id=m.tool_call_id, name=m.name,
        tool_calls=[common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                    for c in m.tool_calls])


def _guidance(g: Guidance) -> common_pb2.Guidance:
    return common_pb2.Guidance(
        tools_json=g.tools_json, tool_choice=g.tool_choice,
        parallel_tool_calls=g.parallel_tool_calls, response_format=g.response_format,
        json_schema=g.json_schema)


@dataclass(frozen=True)
class SavedSession:
    tenant: str
    session_id: str
    tokens: int


def saved_sessions(msg: scheduler_pb2.HeartbeatMsg) -> list[SavedSession]:
    """The session saves a heartbeat reports."""
    return [SavedSession(s.tenant, s.session_id, s.tokens) for s in msg.saved]


def with_kv_source(
    request: common_pb2.GenerateRequest, kvstore_address: str, tokens: int
) -> common_pb2.GenerateRequest:
    """``request`` for a node that must pull the session's KV from ``kvstore_address``."""
    out = common_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.kv_source = kvstore_address
    out.kv_source_tokens = tokens
    return out


def without_reuse(request: common_pb2.GenerateRequest) -> common_pb2.GenerateRequest:
    """``request`` marked to reuse no KV at all (the ``recompute`` policy)."""
    out = common_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.no_reuse = True
    return out


def device_only(request: common_pb2.GenerateRequest) -> common_pb2.GenerateRequest:
    """``request`` marked to reuse only the device prefix cache (the ``prefix`` policy)."""
    out = common_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.device_only = True
    return out


def beat(msg: scheduler_pb2.HeartbeatMsg) -> tuple[str, Load]:
    """(node_id, load) of one heartbeat."""
    return msg.node_id, load(msg)


def heartbeat_ack(known: bool, in_rotation: bool) -> scheduler_pb2.HeartbeatAck:
    return scheduler_pb2.HeartbeatAck(known=known, in_rotation=in_rotation)


def register_reply(heartbeat_interval_s: float) -> scheduler_pb2.RegisterNodeReply:
    return scheduler_pb2.RegisterNodeReply(accepted=True,
                                           heartbeat_interval_s=heartbeat_interval_s)
