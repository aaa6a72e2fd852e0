"""Two scheduler replicas against the fake API server: the one holding the Lease serves;
the standby answers only /healthz and /leaderz (503: not ready, no traffic), refuses node
registrations, and serves once the leader stops (its Lease released)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer

from services.scheduler.app import Running
from services.scheduler.app import start as start_scheduler
from services.scheduler.config import SchedulerConfig
from shared.config import ConfigError, load
from shared.grpc_server import insecure_channel
from shared.proto import scheduler_pb2, scheduler_pb2_grpc
from tests.unit.scheduler.lease.test_election import FakeApiServer


async def replica(stack: AsyncExitStack, url: str, token: Path, who: str,
                  **more: object) -> Running:
    config = load(SchedulerConfig, "scheduler", overrides={
        "port": 0, "grpc_port": 0, "anonymous": True, "lease_name": "overture-scheduler",
        "lease_namespace": "ovt", "lease_identity": who, "lease_api_url": url,
        "lease_token_file": str(token), "lease_ca_file": "", "lease_duration_s": 1.0,
        "lease_renew_s": 0.2, **more})
    return await start_scheduler(config, stack)


async def status(http: aiohttp.ClientSession, port: int, path: str) -> tuple[int, dict]:
    async with http.get(f"http://127.0.0.1:{port}{path}") as r:
        return r.status, await r.json()


async def until_leader(http: aiohttp.ClientSession, port: int) -> None:
    for _ in range(200):
        if (await status(http, port, "/leaderz"))[0] == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never became the leader")


async def test_the_standby_serves_nothing_until_the_leader_goes(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("sa-token")
    fake = FakeApiServer()
    server = TestServer(fake.app())
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with AsyncExitStack() as outer, aiohttp.ClientSession() as http:
            first_stack = AsyncExitStack()
            a = await replica(first_stack, url, token, "pod-a")
            await until_leader(http, a.http_port)
            b = await replica(outer, url, token, "pod-b")
            await asyncio.sleep(0.5)  # b looks a few times
            code, body = await status(http, b.http_port, "/leaderz")
            assert code == 503 and body == {"leader": False}
            assert (await status(http, b.http_port, "/healthz"))[0] == 200
            code, body = await status(http, b.http_port, "/v1/models")
            assert code == 503 and body["error"]["code"] == "standby"
            async with insecure_channel(f"127.0.0.1:{b.grpc_port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await scheduler_pb2_grpc.SchedulerStub(ch).RegisterNode(
                        scheduler_pb2.RegisterNodeRequest(node_id="n", address="h:1"))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            await first_stack.aclose()  # the leader stops (and releases the Lease)
            await until_leader(http, b.http_port)
            assert (await status(http, b.http_port, "/v1/models"))[0] == 200
            assert fake.lease["spec"]["holderIdentity"] == "pod-b"
    finally:
        await server.close()


async def test_a_renewal_too_slow_for_the_duration_fails_at_start(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        with pytest.raises(ConfigError, match="lease_renew_s"):
            await replica(stack, "http://127.0.0.1:9", tmp_path / "t", "pod-a",
                          lease_renew_s=0.5)
