"""The engine-pool data path: the kvstore reads and writes the engine's KV pool directly.

``EnginePoolPath`` is its surface (what the gRPC service calls); ``attach`` maps a pool,
``lookup`` (``find_stored_prefix``) and ``leases`` find and hold a stored prefix, ``load``
and ``save`` copy chunks in and out of pool blocks, ``fences`` tell when a dropped call is
over.
"""

from services.kvstore.engine_path.attach import MappedPool, PoolError, PoolGeometry, PoolRegistry
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import (
    LayerLoaded,
    LoadRequest,
    LookupRequest,
    SaveRequest,
    SaveResult,
)

__all__ = [
    "EnginePoolPath",
    "LayerLoaded",
    "LoadRequest",
    "LookupRequest",
    "MappedPool",
    "PoolError",
    "PoolGeometry",
    "PoolRegistry",
    "SaveRequest",
    "SaveResult",
]
