"""Start an asyncio gRPC server that also serves the standard health-checking protocol, and
open client channels; both carry the cluster's internal authentication
(``shared/internal_auth.py``) when the process has a cluster secret."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared import internal_auth

# Large enough for a 1 MiB KV chunk plus header in one message.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class GrpcServer:
    """A running server: its bound port and its health servicer (to flip status)."""

    def __init__(
        self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer
    ) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer

    async def set_serving(self, service: str, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(service, status)


@asynccontextmanager
async def serve_grpc(
    host: str,
    port: int,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    grace_s: float = 2.0,
) -> AsyncIterator[GrpcServer]:
    """Bind ``host:port`` (0 = any free port), register servicers, serve health, stop with grace.

    ``service_names`` are the full names (``overture.v1.Engine``) reported SERVING, plus the
    overall server ("").
    """
    # No SO_REUSEPORT (gRPC's default): a second process on the same port must fail to
    # bind, not silently take part of the first one's connections.
    server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
                             interceptors=internal_auth.server_interceptors())
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # (grpcio raises where older versions returned 0)
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port} (port in use?)")
    await server.start()
    running = GrpcServer(server, bound, health_servicer)
    for name in ("", *service_names):
        await running.set_serving(name, True)
    try:
        yield running
    finally:
        for name in ("", *service_names):
            await running.set_serving(name, False)
        await server.stop(grace_s)


def insecure_channel(address: str, max_reconnect_backoff_ms: int = 0) -> grpc.aio.Channel:
    """A client channel with Overture's message-size limits: the one set of channel options
    every service's client uses.

    ``max_reconnect_backoff_ms`` caps gRPC's reconnect backoff (its default grows to two
    minutes): a client polling a peer that is still starting, or that restarts, notices it
    within that time. 0 keeps gRPC's default."""
    options = list(CHANNEL_OPTIONS)
    if max_reconnect_backoff_ms:
        first = min(100, max_reconnect_backoff_ms)
        options += [
            ("grpc.initial_reconnect_backoff_ms", first),
            ("grpc.min_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms),
        ]
    return grpc.aio.insecure_channel(address, options=options,
                                     interceptors=internal_auth.client_interceptors())
