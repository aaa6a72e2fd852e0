"""Typed errors of the engine's public API; ``code`` maps onto gRPC status codes."""

from __future__ import annotations

INVALID_ARGUMENT = "invalid_argument"
NOT_FOUND = "not_found"
RESOURCE_EXHAUSTED = "resource_exhausted"
INTERNAL = "internal"
UNAVAILABLE = "unavailable"

CODES = (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE)


class EngineError(Exception):
    """A request cannot be served; ``code`` is one of ``CODES``, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CODES:
            raise ValueError(f"unknown engine error code {code!r}; known: {', '.join(CODES)}")
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"EngineError({self.code!r}, {self.message!r})"
