"""Authentication of the cluster's internal traffic: a secret every member holds.

Every internal gRPC call (node registration and heartbeats, the engine, the nodemgr, the
kvstore, peers' pulls) and every request on the kvstores' chunk stream carries a token
derived from the cluster secret; a service configured with a secret refuses anything
without it (``UNAUTHENTICATED``), comparing in constant time. Health checks stay open:
they tell nothing but "serving", and orchestrators probe them without credentials.

The secret is process-wide, set once at start-up from the ``cluster`` config section
(``shared/service_main.py``): every server the process starts and every channel it opens
use it, so no constructor in between has to carry it. A process that never set one (a
unit test starting a servicer in-process) neither sends nor checks anything.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

METADATA_KEY = "x-overture-cluster-token"
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # callable without the token
MIN_SECRET_CHARS = 16


class InternalAuth:
    """The token of one cluster secret, and the check of a presented one."""

    def __init__(self, secret: str) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the cluster secret must have at least {MIN_SECRET_CHARS} "
                             "characters (`overture secret` makes one)")
        self._secret = secret.encode()
        # What travels is a digest: the configured secret itself never leaves the process.
        self.token = hashlib.sha256(b"overture-cluster:" + secret.encode()).hexdigest()
        self._token_bytes = self.token.encode()
        # The root of the per-tenant MAC keys of stored KV (``shared/chunk_mac.py``).
        self.kv_mac_root = self.derive("overture-kv-mac")

    def derive(self, label: str) -> bytes:
        """A 32-byte key for ``label`` from the secret (HMAC-SHA256): one per purpose, so
        no purpose's key tells anything about another's or about the secret."""
        return hmac.digest(self._secret, label.encode(), "sha256")

    def accepts(self, token: str | bytes | None) -> bool:
        if token is None:
            return False
        presented = token if isinstance(token, bytes) else token.encode(errors="replace")
        return hmac.compare_digest(presented, self._token_bytes)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self.token),)


_current: InternalAuth | None = None


def configure(secret: str | None) -> InternalAuth | None:
    """Set (or with ``None`` clear) this process's cluster secret."""
    global _current
    _current = InternalAuth(secret) if secret is not None else None
    return _current


def current() -> InternalAuth | None:
    return _current


# ------------------------------------------------------------------------------- server


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that lacks the cluster's token."""

    def __init__(self, auth: InternalAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        token = next((v for k, v in details.invocation_metadata or ()
                      if k == METADATA_KEY), None)
        if self.auth.accepts(token):
            return handler
        return _refusal(handler)


_REFUSAL = "this service needs the cluster's token (cluster.secret); the call had none or another"


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that refuses without reading the request."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # (never reached: makes this an async generator)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    auth = current()
    return [RequireToken(auth)] if auth is not None else []


# ------------------------------------------------------------------------------- client


def _with_token(details: grpc.aio.ClientCallDetails, auth: InternalAuth
                ) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(METADATA_KEY, auth.token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


class _Token:
    def __init__(self, auth: InternalAuth) -> None:
        self.auth = auth


# (grpc files each interceptor under the first call kind it implements: one class a kind)
class _UnaryUnary(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any
                                    ) -> Any:
        return await continuation(_with_token(details, self.auth), request)


class _UnaryStream(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any
                                     ) -> Any:
        return await continuation(_with_token(details, self.auth), request)


class _StreamUnary(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self.auth), request_iterator)


class _StreamStream(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self.auth), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    auth = current()
    if auth is None:
        return []
    return [_UnaryUnary(auth), _UnaryStream(auth), _StreamUnary(auth), _StreamStream(auth)]
