"""Where a chunk checksum (seal or verify) runs: inline, or on a worker thread if big.

Hashing a chunk-sized blob costs less than handing it to a thread and back (the kvstore
README has the numbers), so only blobs big enough to stall the event loop noticeably go
to a thread (the hash releases the GIL there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.kvstore.tiers.base import Blob
from shared.chunk_codec import seal_chunk

OFF_LOOP_BYTES = 4 << 20  # ~0.15 ms of hashing


async def sealed(blob: Blob) -> Blob:
    """``blob`` with its checksum: a chunk this process encoded is sealed lazily (by its
    write-behind, or here before it leaves the process; sealing is idempotent)."""
    if isinstance(blob, bytearray):
        await checksum_work(seal_chunk, blob)
    return blob


async def checksum_work(fn: Callable[[Any], None], blob: Blob) -> None:
    """``fn(blob)`` (seal_chunk or verify_chunk), off the loop for big blobs."""
    if len(blob) >= OFF_LOOP_BYTES:
        await asyncio.to_thread(fn, blob)
    else:
        fn(blob)
