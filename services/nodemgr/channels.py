"""Client channels of the node manager.

gRPC's default reconnect backoff grows to two minutes; a node manager polling an engine that
is still loading, or a scheduler that starts later, would then notice them long after they
are up. These channels retry at most every half second.
"""

from __future__ import annotations

import grpc

from shared.grpc_server import CHANNEL_OPTIONS

FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def fast_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *FAST_RECONNECT])
