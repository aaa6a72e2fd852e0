"""Internal traffic carries the cluster's token: a server with a secret refuses calls of
every kind without it (health checks excepted), the kvstores' chunk stream too, and a
service will not start without a secret unless told to, on loopback only."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.kvstore.peers.data_plane import LEN, MISSING, ChunkServer, request_bytes
from services.kvstore.tiers import DramTier
from shared import internal_auth
from shared.cluster_config import ClusterConfig, resolve_secret, start_internal_auth
from shared.config import ConfigError
from shared.grpc_server import insecure_channel, serve_grpc
from tests.internal import use_test_secret
from tests.unit.kvstore.stores import make_store

SECRET = "a-test-secret-of-enough-length"


@pytest.fixture(autouse=True)
def test_secret_after() -> Iterator[None]:
    yield
    use_test_secret()


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"echo:" + request


async def _count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(3):
        yield bytes([i])


async def _sum(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    n = 0
    async for r in requests:
        n += len(r)
    return bytes([n])


HANDLERS = grpc.method_handlers_generic_handler("t.T", {
    "Echo": grpc.unary_unary_rpc_method_handler(_echo),
    "Count": grpc.unary_stream_rpc_method_handler(_count),
    "Sum": grpc.stream_unary_rpc_method_handler(_sum),
})


async def _calls(address: str) -> list[object]:
    """Each kind of call once; a StatusCode where it failed."""
    out: list[object] = []
    async with insecure_channel(address) as ch:
        async def parts() -> AsyncIterator[bytes]:
            yield b"ab"
            yield b"c"
        for call in (lambda: ch.unary_unary("/t.T/Echo")(b"x", timeout=5),
                     lambda: _collect(ch.unary_stream("/t.T/Count")(b"", timeout=5)),
                     lambda: ch.stream_unary("/t.T/Sum")(parts(), timeout=5)):
            try:
                out.append(await call())
            except grpc.aio.AioRpcError as e:
                out.append(e.code())
        health = health_pb2_grpc.HealthStub(ch)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        out.append(reply.status == health_pb2.HealthCheckResponse.SERVING)
    return out


async def _collect(call: object) -> list[bytes]:
    return [m async for m in call]  # type: ignore[attr-defined]


async def test_calls_without_the_cluster_token_are_refused_and_health_stays_open() -> None:
    internal_auth.configure(SECRET)
    async with serve_grpc("127.0.0.1", 0, [lambda s: s.add_generic_rpc_handlers((HANDLERS,))],
                          ["t.T"], grace_s=0.1) as server:
        address = f"127.0.0.1:{server.port}"
        assert await _calls(address) == [b"echo:x", [b"\0", b"\1", b"\2"], b"\3", True]
        internal_auth.configure(None)  # a caller without the secret
        denied = grpc.StatusCode.UNAUTHENTICATED
        assert await _calls(address) == [denied, denied, denied, True]
        internal_auth.configure("another-secret-entirely")  # another cluster's
        assert await _calls(address) == [denied, denied, denied, True]


async def test_the_chunk_stream_needs_the_token_too() -> None:
    internal_auth.configure(SECRET)
    async with make_store([DramTier(1 << 24)]) as store:
        server = ChunkServer(store, lambda lease: {}, "127.0.0.1", 0)
        port = await server.start()
        loop = asyncio.get_running_loop()
        try:
            for secret, closed in ((None, True), ("another-secret-entirely", True),
                                   (SECRET, False)):
                internal_auth.configure(secret)
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", port))
                await loop.sock_sendall(s, request_bytes("", ["t/m/00/0"]))
                got = await asyncio.wait_for(loop.sock_recv(s, LEN.size), 5)
                s.close()
                if closed:
                    assert got == b"", secret
                else:
                    assert struct.unpack("<I", got) == (MISSING,)
        finally:
            await server.close()


def test_a_service_starts_only_with_a_secret_or_insecure_on_loopback(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no cluster secret"):
        start_internal_auth(ClusterConfig(), "engine", "127.0.0.1")
    with pytest.raises(ConfigError, match="loopback"):
        start_internal_auth(ClusterConfig(insecure=True), "engine", "0.0.0.0")
    start_internal_auth(ClusterConfig(insecure=True), "engine", "127.0.0.1")
    assert internal_auth.current() is None
    with pytest.raises(ConfigError, match="at least"):
        start_internal_auth(ClusterConfig(secret="short"), "engine", "0.0.0.0")
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert resolve_secret(ClusterConfig(secret_file=str(f))) == SECRET
    with pytest.raises(ConfigError, match="both"):
        resolve_secret(ClusterConfig(secret=SECRET, secret_file=str(f)))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_secret(ClusterConfig(secret_file=str(tmp_path / "none")))
    start_internal_auth(ClusterConfig(secret_file=str(f)), "engine", "0.0.0.0")
    auth = internal_auth.current()
    assert auth is not None and SECRET not in auth.token  # the secret never travels
    assert auth.accepts(auth.token) and not auth.accepts(None) and not auth.accepts("x")
