"""Node manager: registration retries, re-registration, Status, engine loss reporting."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from services.local_cluster import free_port
from services.nodemgr.app import start as start_nodemgr
from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.engine_link import EngineUnavailable
from services.scheduler.app import start as start_scheduler
from services.scheduler.config import SchedulerConfig
from shared.config import load
from shared.grpc_server import insecure_channel, serve_grpc
from shared.proto import engine_pb2_grpc, nodemgr_pb2, nodemgr_pb2_grpc
from tests.unit.scheduler.conftest import make_cluster
from tests.unit.scheduler.fake_engine import FakeEngine


async def wait_for(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_registers_once_the_scheduler_appears_and_again_when_forgotten() -> None:
    async with AsyncExitStack() as stack:
        engine = FakeEngine()
        server = await stack.enter_async_context(
            serve_grpc(
                "127.0.0.1",
                0,
                register=[lambda s: engine_pb2_grpc.add_EngineServicer_to_server(engine, s)],
                service_names=[],
                grace_s=0.1,
            )
        )
        grpc_port = free_port()
        nm = load(
            NodeManagerConfig,
            "nodemgr",
            overrides={
                "port": 0,
                "node_id": "late",
                "heartbeat_interval_s": 0.05,
                "register_backoff_max_s": 0.1,
                "scheduler_address": f"127.0.0.1:{grpc_port}",
                "engine_address": f"127.0.0.1:{server.port}",
            },
        )
        await start_nodemgr(nm, stack)
        await asyncio.sleep(0.3)  # the node manager retries meanwhile
        sched = await start_scheduler(
            load(
                SchedulerConfig,
                "scheduler",
                overrides={
                    "port": 0,
                    "grpc_port": grpc_port,
                    "heartbeat_interval_s": 0.05,
                    "anonymous": True,
                },
            ),
            stack,
        )
        registry = sched.state.registry
        await wait_for(lambda: [n.node_id for n in registry.healthy("demo")] == ["late"])
        registry.remove("late")
        await wait_for(lambda: [n.node_id for n in registry.healthy("demo")] == ["late"])
        node = registry.get("late")
        assert node is not None and node.info.models[0].max_model_len == 64


async def test_status_reports_engine_load() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack)
        address = c.scheduler.state.registry.get("node0").info.address
        channel = insecure_channel(address)
        stack.push_async_callback(channel.close)
        status = await nodemgr_pb2_grpc.NodeManagerStub(channel).Status(
            nodemgr_pb2.NodeStatusRequest(), timeout=2
        )
        assert status.node_id == "node0"
        assert [m.name for m in status.models] == ["demo"]
        assert status.engine.blocks_total == 100


async def test_missing_engine_fails_start_with_a_clear_error() -> None:
    async with AsyncExitStack() as stack:
        nm = load(
            NodeManagerConfig,
            "nodemgr",
            overrides={
                "port": 0,
                "engine_address": f"127.0.0.1:{free_port()}",
                "engine_wait_s": 1,
                "engine_status_timeout_s": 0.2,
            },
        )
        with pytest.raises(EngineUnavailable, match="engine_wait_s"):
            await start_nodemgr(nm, stack)


async def test_engine_coming_back_returns_the_node_to_rotation() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack)
        engine_port = int(c.engine_servers[0].port)
        await c.engine_servers[0].server.stop(0)
        await c.wait_nodes(0)
        problem = c.scheduler.state.registry.get("node0").load.problem
        assert "engine" in problem
        await stack.enter_async_context(
            serve_grpc(
                "127.0.0.1",
                engine_port,
                register=[lambda s: engine_pb2_grpc.add_EngineServicer_to_server(c.engine, s)],
                service_names=[],
                grace_s=0.1,
            )
        )
        await c.wait_nodes(1)
