"""One gRPC channel per peer kvstore, and the bandwidth measured on each link.

The load-or-recompute planner on the engine needs a rate for a span that lives on a peer;
it gets the EWMA of this node's pulls from that peer (bytes over the seconds from the
request to the last chunk), seeded with ``kvstore.peer_bytes_per_s`` until measured.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import grpc

from shared.grpc_server import insecure_channel
from shared.proto import kvstore_pb2_grpc as pb_grpc

_MIN_SAMPLE_BYTES = 64 << 10  # a tiny pull measures round trips, not the link
PULLED_KEYS = 1 << 20  # chunk keys remembered as pulled (~100 bytes each)


class PulledKeys:
    """Chunk keys this node loaded from a peer, most recent last (bounded). The chunks
    went straight into the engine's pool; the turn's save then stores them here (DRAM
    and local tiers) but not in the shared S3 tier, which the peer writes itself."""

    def __init__(self, capacity: int = PULLED_KEYS) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, layers: Iterable[Iterable[str]]) -> None:
        for keys in layers:
            for k in keys:
                self._keys[k] = None
                self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class PeerLinks:
    def __init__(self, prior_bytes_per_s: float, alpha: float = 0.3) -> None:
        self.prior = prior_bytes_per_s
        self.alpha = alpha
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.KVStoreStub]] = {}
        self._rate: dict[str, float] = {}

    def stub(self, address: str) -> pb_grpc.KVStoreStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = insecure_channel(address)
            entry = self._channels[address] = (channel, pb_grpc.KVStoreStub(channel))
        return entry[1]

    def observe(self, address: str, nbytes: int, seconds: float) -> None:
        if nbytes < _MIN_SAMPLE_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        old = self._rate.get(address)
        self._rate[address] = sample if old is None else old + self.alpha * (sample - old)

    def bytes_per_s(self, address: str) -> float:
        return self._rate.get(address, self.prior)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
