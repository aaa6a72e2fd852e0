"""The bounds a server puts on request bodies, from its configuration (``scheduler.max_n``
and the like). The bodies' schemas are built from them, so ``/openapi.json`` publishes the
bounds this server enforces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_n: int = 8  # choices per prompt
    max_prompts: int = 8  # prompts in one /v1/completions request
    default_max_tokens: int = 0  # max_tokens when a request gives none (0: up to the context)
    max_messages: int = 2048  # messages in one chat request (and Responses input items)
    max_tokens: int = 2**31 - 1  # the ceiling of max_tokens (the engine's field is an int32)
    strict_fields: bool = False  # a field nobody documents is a 400 (else ignored, named)
