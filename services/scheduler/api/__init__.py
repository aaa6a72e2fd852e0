"""The public API as data, free of HTTP and of protobuf: request bodies as schema nodes,
their validation into request dataclasses, the OpenAPI document, OpenAI's output shapes
and OpenAI-shaped errors.

    bytes ─► json_body.parse_json ─► validation.validate (bodies.py's schemas, limits.py)
          ─► request.ApiRequest ... chunk.Chunk ─► openai_format (objects, SSE chunks)
"""

from services.scheduler.api.bodies import ADVISORY, body_schema
from services.scheduler.api.chunk import Chunk, TokenLogprob, ToolCallOut
from services.scheduler.api.errors import ApiError, from_grpc, invalid, without_addresses
from services.scheduler.api.input_budget import check_input_budget
from services.scheduler.api.json_body import check_body_size, parse_json
from services.scheduler.api.limits import Limits
from services.scheduler.api.logprobs_format import chat_logprobs, legacy_logprobs
from services.scheduler.api.openai_format import (
    SSE_DONE,
    ChoiceState,
    Envelope,
    full_response,
    kv_source,
    new_id,
    sse,
    stream_chunk,
    tool_call_deltas,
    usage_chunk,
)
from services.scheduler.api.openapi import openapi_document
from services.scheduler.api.request import (
    ApiRequest,
    Choice,
    Endpoint,
    Guidance,
    Message,
    Prompt,
    Sampling,
    ToolCall,
)
from services.scheduler.api.responses_body import responses_body
from services.scheduler.api.validation import guidance, validate

__all__ = [
    "ADVISORY",
    "SSE_DONE",
    "ApiError",
    "ApiRequest",
    "Choice",
    "ChoiceState",
    "Chunk",
    "Endpoint",
    "Envelope",
    "Guidance",
    "Limits",
    "Message",
    "Prompt",
    "Sampling",
    "TokenLogprob",
    "ToolCall",
    "ToolCallOut",
    "body_schema",
    "chat_logprobs",
    "check_body_size",
    "check_input_budget",
    "from_grpc",
    "full_response",
    "guidance",
    "invalid",
    "kv_source",
    "legacy_logprobs",
    "new_id",
    "openapi_document",
    "parse_json",
    "responses_body",
    "sse",
    "stream_chunk",
    "tool_call_deltas",
    "usage_chunk",
    "validate",
    "without_addresses",
]
