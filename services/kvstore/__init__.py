"""kvstore: the node's data plane — DRAM arena, RocksDB, S3 — behind ``TieredStore``.

Public surface for other services (in-process use, e.g. the engine hand-off):
``TieredStore`` (put/get by chunk key, per layer, manifests), ``Manifest``, the ``Tier``
interface and ``build_tiers``, the typed errors, and ``PoolDataPath`` (the same-node
data path to the engine's KV pool, ``pool_path.py``). The chunk format is
``shared.chunk_codec``.
"""

from __future__ import annotations

from services.kvstore.errors import (
    ChunkCorrupt,
    ManifestIncomplete,
    StorageError,
    TierOpenError,
    TierUnavailable,
    WriteDropped,
)
from services.kvstore.manifest import Manifest
from services.kvstore.pool_map import PoolError, PoolGeometry
from services.kvstore.pool_path import PoolDataPath
from services.kvstore.store import PutReceipt, TieredStore, layer_priority

__all__ = [
    "ChunkCorrupt",
    "Manifest",
    "ManifestIncomplete",
    "PoolDataPath",
    "PoolError",
    "PoolGeometry",
    "PutReceipt",
    "StorageError",
    "TierOpenError",
    "TierUnavailable",
    "TieredStore",
    "WriteDropped",
    "layer_priority",
]
