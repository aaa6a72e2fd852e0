"""The gRPC channels to the nodes' managers, one per address: the dispatcher streams
generations over them, the advisor sends advisories, the placement loop moves models."""

from __future__ import annotations

import grpc

from shared.grpc_server import insecure_channel
from shared.proto import nodemgr_pb2_grpc


class NodeChannels:
    """One gRPC channel per node address, opened on first use and closed at shutdown."""

    def __init__(self) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, nodemgr_pb2_grpc.NodeManagerStub]] = {}

    def stub(self, address: str) -> nodemgr_pb2_grpc.NodeManagerStub:
        entry = self._stubs.get(address)
        if entry is None:
            channel = insecure_channel(address)
            entry = (channel, nodemgr_pb2_grpc.NodeManagerStub(channel))
            self._stubs[address] = entry
        return entry[1]

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
