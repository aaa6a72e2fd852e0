"""Client channels of the node manager.

A node manager polling an engine that is still loading, or a scheduler that starts later,
must notice them soon after they are up: these channels retry at most every half second.
"""

from __future__ import annotations

import grpc

from shared.grpc_server import insecure_channel

MAX_RECONNECT_BACKOFF_MS = 500


def fast_channel(address: str) -> grpc.aio.Channel:
    return insecure_channel(address, MAX_RECONNECT_BACKOFF_MS)
