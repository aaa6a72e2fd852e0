"""What one sequence carries for offload: its plan, the load under way, what is saved.

    before admission   plan       the stored prefix to load (from the reuse planner), or None
    first step         load       the part of the plan being loaded (trimmed by the device
                       readiness  hit), and per-layer progress of its RPC
    loaded             loaded_from   where the loaded KV was ("local", "s3", "peer")
    admitted           prefetched    on blocks an advisory prefetched: whole or partial
    while generating   saved_blocks  leading blocks already handed to the kvstore

Touched only by the engine's worker thread. Core data (every ``Sequence`` has one), so
it lives beside ``sequence.py``; ``offload/`` fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.layer_readiness import LayerReadiness
from services.engine.reuse_plan import ReusePlan


@dataclass(eq=False)
class OffloadState:
    plan: ReusePlan | None = None
    load: ReusePlan | None = None
    readiness: LayerReadiness | None = None
    counted: bool = False  # this request's device/loaded tokens entered the stats
    saved_blocks: int = 0  # a multiple of the kvstore's chunk, in blocks
    loaded_from: str = ""  # where a completed load came from: "local", "s3" or "peer"
    partial_blocks: int = 0  # admitted with this many partially resident blocks
    prefetched: str = ""  # admitted on advised blocks: "device_prefetched" or "device_partial"

    def load_after(self, device_blocks: int) -> ReusePlan | None:
        """The part of the plan still worth loading once ``device_blocks`` leading blocks
        turned out to be on device."""
        return self.plan.trimmed(device_blocks) if self.plan is not None else None
