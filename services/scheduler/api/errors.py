"""OpenAI-shaped API errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from typing import Any

import grpc

# HTTP status -> OpenAI error ``type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """A request failure the client should see with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request the client must fix."""
    return ApiError(400, message, param=param, code=code)


# Status codes a node (or the engine behind it) returns, and what the client sees.
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, None),
    grpc.StatusCode.OUT_OF_RANGE: (400, None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, None),
    grpc.StatusCode.NOT_FOUND: (404, "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "resource_exhausted"),
    grpc.StatusCode.UNAVAILABLE: (503, "node_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (503, "cancelled"),
}


def from_grpc(code: grpc.StatusCode, details: str | None, node_id: str) -> ApiError:
    """Translate a node's gRPC failure into the error the HTTP client sees."""
    status, err_code = _GRPC_TO_HTTP.get(code, (500, "node_error"))
    if status >= 500 or not details:
        # (the details of a transport failure name internal addresses: the log has them)
        return ApiError(status, f"node {node_id} failed ({code.name}); the scheduler's log "
                        "has the details", code=err_code)
    return ApiError(status, without_addresses(details), code=err_code)


_ADDRESS = re.compile(r"(ipv[46]:)?(\[[0-9a-fA-F:]+\]|\d{1,3}(\.\d{1,3}){3})(:\d+)?")


def without_addresses(text: str) -> str:
    """``text`` with IP addresses (and ports) replaced: clients learn no internal ones."""
    return _ADDRESS.sub("[internal]", text)
