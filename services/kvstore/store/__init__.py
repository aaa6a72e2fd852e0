"""The chunk store: tiers in order, the write-behind, the durability ledger and the sweep.

``TieredStore`` is the surface; the rest are its parts, each told what it needs.
"""

from services.kvstore.store.chunk_reads import decode_stored, layer_priority
from services.kvstore.store.chunk_writes import PutReceipt
from services.kvstore.store.durability import DurabilityLedger
from services.kvstore.store.keys import chunk_tier_key, manifest_tier_key
from services.kvstore.store.tiered import TieredStore

__all__ = [
    "DurabilityLedger",
    "PutReceipt",
    "TieredStore",
    "chunk_tier_key",
    "decode_stored",
    "layer_priority",
    "manifest_tier_key",
]
