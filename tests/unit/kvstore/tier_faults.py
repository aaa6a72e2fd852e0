"""Faults injected into a real SSD tier's storage behind its back (tests only): what a
disk that rots or loses a file looks like to the tier, with its catalog unchanged."""

from __future__ import annotations

import os
from pathlib import Path

from services.kvstore.tiers.ssd import SsdTier
from services.kvstore.tiers.ssd_catalog import VALUE_PREFIX


async def overwrite(tier: SsdTier, key: str, blob: bytes) -> None:
    """Replace the stored bytes of ``key`` without telling the catalog."""
    file_no = tier._files.get(key)
    if file_no is None:
        await tier._run(tier._live_db().put, VALUE_PREFIX + key.encode(), blob)
    else:
        await tier._run(Path(tier._file(file_no)).write_bytes, blob)


async def lose(tier: SsdTier, key: str) -> None:
    """Lose the stored bytes of ``key`` but keep its catalog entry."""
    file_no = tier._files.get(key)
    if file_no is None:
        await tier._run(tier._live_db().delete, VALUE_PREFIX + key.encode())
    else:
        await tier._run(os.unlink, tier._file(file_no))
