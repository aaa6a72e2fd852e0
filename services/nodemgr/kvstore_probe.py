"""Is this node's kvstore answering, and are its tiers? Asked once per heartbeat.

A node whose kvstore is down still serves (its engine recomputes what it would have
reused), so the answer does not take it out of rotation: the heartbeat reports it as
*degraded*, which the scheduler shows in ``/readyz``, ``/admin/nodes`` and its metrics.
So does a kvstore that answers but has a tier down (S3 unreachable: nothing new becomes
durable or shared with other nodes), as its ``Status`` says.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.nodemgr.channels import fast_channel
from shared.proto import kvstore_pb2 as kv_pb
from shared.proto import kvstore_pb2_grpc as kv_grpc

KVSTORE_SERVICE = "overture.v1.KVStore"


class KVStoreProbe:
    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = fast_channel(address) if address else None
        self.stub = health_pb2_grpc.HealthStub(self.channel) if self.channel else None
        self.kv = kv_grpc.KVStoreStub(self.channel) if self.channel else None

    async def problem(self) -> str:
        """Empty when the kvstore answers SERVING (or the node has none), else why not."""
        if self.stub is None:
            return ""
        try:
            reply = await self.stub.Check(
                health_pb2.HealthCheckRequest(service=KVSTORE_SERVICE), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as e:
            return f"kvstore at {self.address} unreachable ({e.code().name}): serving by recompute"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"kvstore at {self.address} not serving: serving by recompute"
        return await self._tiers()

    async def _tiers(self) -> str:
        """Empty when every tier of the kvstore is healthy, else its detail."""
        assert self.kv is not None
        try:
            status = await self.kv.Status(kv_pb.KVStoreStatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ""  # (a kvstore without tier reports, e.g. an older one mid-upgrade)
            return f"kvstore at {self.address}: no status ({e.code().name})"
        if status.healthy:
            return ""
        return f"kvstore at {self.address}: {status.detail[:300]}"

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
