"""The node's Reuse Store (Tangram §3.1-§3.3): model weights as fingerprinted tensors in
one arena every engine of the node maps, shared across models, kept resident while
memory allows, evicted by cost and placed by Partitioned-Gain Packing.

    fingerprint.py  tensor fingerprints, a model's index
    arena.py        the shared-memory arena (CPU); cuda_arena.py its CUDA twin (untested)
    regions.py      the region list in physical order
    eviction.py     Stage 1: minimal-cost eviction (Equation 2)
    packing.py      Stage 2: Partitioned-Gain Packing (Algorithm 1)
    allocator.py    placing tensors: packing, then compaction only if it fails
    stats.py        counters, load bandwidth, access frequency
    store.py        the Tensor Mapping and activation plans (a ResidencySource)
"""

from __future__ import annotations

from services.nodemgr.reuse_store.allocator import NoRoom
from services.nodemgr.reuse_store.arena import ShmArena
from services.nodemgr.reuse_store.fingerprint import ModelIndex, index_model
from services.nodemgr.reuse_store.store import Mapped, ReuseStore

__all__ = ["Mapped", "ModelIndex", "NoRoom", "ReuseStore", "ShmArena", "index_model"]
