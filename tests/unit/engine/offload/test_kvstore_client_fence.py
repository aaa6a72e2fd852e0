"""The connector lets a failed load's or save's blocks go only after FencePoolOp: until the
kvstore says the call can no longer touch the pool, a deadline on our side proves nothing
(a copy under way on the kvstore runs to its end)."""

from __future__ import annotations

import asyncio

import grpc

from services.engine.config import EngineConfig, OffloadConfig
from services.engine.layer_readiness import LayerReadiness
from services.engine.offload import KVStoreClient, LoadJob, PoolGeometry, SaveJob
from services.engine.reuse_plan import ReusePlan
from shared.kv_layout import KVSpan
from shared.proto import kvstore_pb2
from shared.session_key import SessionKey

GEOMETRY = PoolGeometry("pool", "cpu", 8, 16, 1, 8, "float32", 2, "fp")


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")


class FakeStub:
    """LoadIntoPool and SaveFromPool fail (our deadline); FencePoolOp fails ``flaky``
    times, then answers once ``allow`` is set."""

    def __init__(self, flaky: int = 0) -> None:
        self.fenced: list[str] = []
        self.load_ops: list[str] = []
        self.save_ops: list[str] = []
        self.allow = asyncio.Event()
        self.flaky = flaky

    def LoadIntoPool(self, req: kvstore_pb2.LoadIntoPoolRequest, timeout: float):
        self.load_ops.append(req.op_id)

        async def stream():
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
            yield  # an async generator

        return stream()

    async def SaveFromPool(self, req: kvstore_pb2.SaveFromPoolRequest, timeout: float):
        self.save_ops.append(req.op_id)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)

    async def FencePoolOp(self, req, timeout: float, wait_for_ready: bool):
        if self.flaky:
            self.flaky -= 1
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        await self.allow.wait()
        self.fenced.append(req.op_id)
        return kvstore_pb2.FencePoolOpReply()

    async def AttachPool(self, req, timeout: float, wait_for_ready: bool):
        await asyncio.sleep(3600)  # the re-attach the error triggers never matters here


def connector(stub: FakeStub) -> KVStoreClient:
    c = KVStoreClient(EngineConfig(offload=OffloadConfig(attach_backoff_max_s=0.01)),
                    GEOMETRY)
    c._stub = stub  # type: ignore[assignment]
    c.pool_id = "pool-1"
    return c


async def test_a_failed_load_is_finished_only_after_its_fence() -> None:
    stub = FakeStub(flaky=2)
    c = connector(stub)
    ready = LayerReadiness(2)
    ended = asyncio.Event()
    plan = ReusePlan((KVSpan(b"h", 0, 1, "ssd", 1),), "lease-1", 0, 1)
    c.start_load(LoadJob("r", "default", plan, (5, 6), ready), ended.set)
    await asyncio.sleep(0.2)
    assert ready.failed and not ready.finished and not ended.is_set()  # blocks stay parked
    stub.allow.set()
    await asyncio.wait_for(ended.wait(), 5)
    assert ready.finished and stub.fenced == stub.load_ops and stub.load_ops[0]
    await c.close()


async def test_a_failed_save_is_unpinned_only_after_its_fence() -> None:
    stub = FakeStub()
    c = connector(stub)
    done: list[int] = []
    job = SaveJob(7, SessionKey("default", "s"), (b"h",), 16, 0, (1, 2))
    c.start_save(job, lambda j, ok: done.append(j.job_id) if not ok else None)
    await asyncio.sleep(0.1)
    assert done == []  # still pinned: the kvstore may be reading the blocks
    stub.allow.set()
    for _ in range(100):
        if done:
            break
        await asyncio.sleep(0.01)
    assert done == [7] and stub.fenced == stub.save_ops
    await c.close()


async def test_op_ids_are_unique_across_connectors() -> None:
    a, b = connector(FakeStub()), connector(FakeStub())
    ids = {a._new_op_id(), a._new_op_id(), b._new_op_id()}
    assert len(ids) == 3


async def test_a_load_refused_for_want_of_a_kvstore_still_reports_its_end() -> None:
    """Not attached: the load fails at once, and ``ended`` runs as after any load (a worker
    waiting for parked blocks is woken)."""
    c = KVStoreClient(EngineConfig(), GEOMETRY)
    ready = LayerReadiness(2)
    ended: list[bool] = []
    plan = ReusePlan((KVSpan(b"h", 0, 1, "ssd", 1),), "", 0, 1)
    c.start_load(LoadJob("r", "default", plan, (5, 6), ready), lambda: ended.append(True))
    assert ready.failed and ready.finished and ended == [True]
    await c.close()
