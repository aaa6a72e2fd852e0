"""kvstore: the node's data plane — DRAM arena, RocksDB, S3 — behind ``TieredStore``.

Public surface for other services (in-process use, e.g. the engine hand-off):
``TieredStore`` (chunks by key across the tiers, ``store/``), ``ManifestStore`` and
``Manifest`` (``manifests/``), the ``Tier`` interface and ``build_tiers`` (``tiers/``),
the typed errors, and ``EnginePoolPath`` (the same-node data path to the engine's KV
pool, ``engine_path/``). The chunk format is ``shared.chunk_codec``.
"""

from __future__ import annotations

from services.kvstore.engine_path.attach import PoolError, PoolGeometry
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.errors import (
    ChunkCorrupt,
    ManifestIncomplete,
    StorageError,
    TierOpenError,
    TierUnavailable,
    WriteDropped,
)
from services.kvstore.manifests import Manifest, ManifestStore
from services.kvstore.store import PutReceipt, TieredStore, layer_priority

__all__ = [
    "ChunkCorrupt",
    "EnginePoolPath",
    "Manifest",
    "ManifestIncomplete",
    "ManifestStore",
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
