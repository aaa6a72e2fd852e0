"""An in-process mini cluster for the scheduler's HTTP tests: the real scheduler and node
manager (``start``) in the test's event loop, with the fake engine behind them; ``call``
to send it one HTTP request, and ``Clock``, a fake clock for the unit tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import aiohttp
import pytest

from services.local_cluster import free_port
from services.nodemgr.app import start as start_nodemgr
from services.nodemgr.config import NodeManagerConfig
from services.scheduler.app import Running
from services.scheduler.app import start as start_scheduler
from services.scheduler.config import SchedulerConfig
from shared.config import load
from shared.grpc_server import serve_grpc
from shared.proto import engine_pb2_grpc
from tests.unit.scheduler.fake_engine import FakeEngine


@dataclass
class MiniCluster:
    scheduler: Running
    engine: FakeEngine
    http: aiohttp.ClientSession
    url: str
    stack: AsyncExitStack
    engine_servers: list = field(default_factory=list)
    engines: list[FakeEngine] = field(default_factory=list)
    # Each node's kvstore address: a free port with nothing behind it (the node manager
    # probes it; a test may serve a health service there).
    kvstore_ports: list[int] = field(default_factory=list)

    async def wait_nodes(self, count: int, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.scheduler.state.registry.healthy()) != count:
            assert loop.time() < deadline, "nodes did not reach the expected count"
            await asyncio.sleep(0.02)


async def make_cluster(
    stack: AsyncExitStack,
    *,
    engine: FakeEngine | None = None,
    nodes: int = 1,
    token_delay_s: float = 0.0,
    kvstore_ports: list[int] | None = None,
    seats: int = 0,
    **scheduler_overrides: object,
) -> MiniCluster:
    """The scheduler and ``nodes`` node managers, each node's kvstore at
    ``kvstore_ports[i]`` (default: free ports with nothing behind them); ``seats``: the
    sequences each engine says it runs at once (0: not said)."""
    overrides = {
        "port": 0,
        "grpc_port": 0,
        "heartbeat_interval_s": 0.1,
        "heartbeat_timeout_s": 1.0,
        "no_node_wait_s": 0.5,
        # (without keys, a local scheduler: anonymous)
        "anonymous": not {"api_keys", "admin_keys", "keys_file"} & set(scheduler_overrides),
        **scheduler_overrides,
    }
    sched = await start_scheduler(load(SchedulerConfig, "scheduler", overrides=overrides), stack)
    engines = (
        [engine] if engine else [FakeEngine(token_delay_s=token_delay_s) for _ in range(nodes)]
    )
    for e in engines:
        e.max_num_seqs = seats or e.max_num_seqs
    servers = []
    if kvstore_ports is None:
        kvstore_ports = [free_port() for _ in range(nodes)]
    for i in range(nodes):
        node_engine = engines[i % len(engines)]
        server = await stack.enter_async_context(
            serve_grpc(
                "127.0.0.1",
                0,
                register=[
                    lambda s, e=node_engine: engine_pb2_grpc.add_EngineServicer_to_server(e, s)
                ],
                service_names=["overture.v1.Engine"],
                grace_s=0.1,
            )
        )
        servers.append(server)
        nm = load(
            NodeManagerConfig,
            "nodemgr",
            overrides={
                "port": 0,
                "node_id": f"node{i}",
                "scheduler_address": f"127.0.0.1:{sched.grpc_port}",
                "engine_address": f"127.0.0.1:{server.port}",
                "heartbeat_interval_s": 0.1,
                "engine_wait_s": 5,
                "kvstore_address": f"127.0.0.1:{kvstore_ports[i]}",
            },
        )
        await start_nodemgr(nm, stack)
    http = await stack.enter_async_context(aiohttp.ClientSession())
    cluster = MiniCluster(
        sched, engines[0], http, f"http://127.0.0.1:{sched.http_port}", stack, servers, engines,
        kvstore_ports,
    )
    await cluster.wait_nodes(nodes)
    return cluster


async def call(c: MiniCluster, method: str, path: str, body: object = None,
               headers: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body)
    async with c.http.request(method, c.url + path, data=data, headers=headers or {}) as r:
        return r.status, json.loads(await r.text()), dict(r.headers)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def cluster() -> AsyncIterator[MiniCluster]:
    async with AsyncExitStack() as stack:
        yield await make_cluster(stack)
