"""Layer-wise streaming of a session's chunks with bounded read-ahead (DESIGN §3).

    consumer  <- yield (layer, i, key, blob) <- ahead: [task, task, ... <= window] <- tiers
    order:    layer 0: chunk 0, 1, ...; layer 1: chunk 0, 1, ...; ...

A slow consumer (a gRPC stream waiting on HTTP/2 flow control, a peer loading into its
pool) stalls the reads instead of buffering a whole session in memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from services.kvstore.manifests.manifest import Manifest
from services.kvstore.store import TieredStore
from services.kvstore.tiers.base import Blob


async def stream_session(
    store: TieredStore,
    manifest: Manifest,
    first_layer: int = 0,
    last_layer: int | None = None,
    window: int = 4,
) -> AsyncIterator[tuple[int, int, str, Blob | None]]:
    """Yield ``(layer, chunk index, key, sealed blob or None)``, lowest layer first.

    At most ``window`` chunks are read ahead of the consumer (flow control: a slow
    consumer stalls the reads rather than buffering a whole session).
    """
    last = (
        manifest.num_layers - 1
        if last_layer is None
        else min(last_layer, manifest.num_layers - 1)
    )
    items = [
        (layer, i, k)
        for layer in range(first_layer, last + 1)
        for i, k in enumerate(manifest.layer_keys(layer))
    ]
    ahead: deque[tuple[tuple[int, int, str], asyncio.Task[Blob | None]]] = deque()
    cursor = 0
    try:
        while cursor < len(items) or ahead:
            while cursor < len(items) and len(ahead) < window:
                item = items[cursor]
                ahead.append((item, asyncio.create_task(store.get_blob(item[2]))))
                cursor += 1
            (layer, i, key), task = ahead.popleft()
            yield layer, i, key, await task
    finally:
        for _item, task in ahead:
            task.cancel()
        await asyncio.gather(*(t for _i, t in ahead), return_exceptions=True)
