"""What one request loads of its prompt's prefix from the node's kvstore: a ``ReusePlan``.

The event loop makes one before the request enters the core (``offload/reuse_planner.py``);
the scheduler admits the request with it, trimmed by what the device holds by then:

    blocks:  | on device ......... | plan.spans (leased in the kvstore) .... | computed
             0              first_block                               end_block
                                    | resident_end: lower layers on device  |

Plain data of the core (the scheduler and every sequence carry it), so it lives beside
them, not inside ``offload/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.kv_layout import KVSpan

SKIP = -1  # a LoadIntoPool target meaning "already on device: do not write"


@dataclass(frozen=True)
class ReusePlan:
    """What to load for one request: ``spans`` cover blocks ``[first_block, end_block)``
    contiguously; ``lease_id`` holds them in the kvstore until loaded or released."""

    spans: tuple[KVSpan, ...]
    lease_id: str
    first_block: int
    end_block: int
    # Blocks [first_block, resident_end) already hold layers [0, resident_layers) on the
    # device (a partially resident prefix): only their upper layers are loaded.
    resident_end: int = 0
    resident_layers: int = 0

    def with_resident(self, blocks: int, layers: int) -> ReusePlan:
        """This plan over a device prefix whose next ``blocks`` blocks hold ``layers``
        lower layers already."""
        return dataclasses.replace(self, resident_end=self.first_block + blocks,
                                   resident_layers=layers if blocks else 0)

    def target_ids(self, ids: list[int], num_layers: int) -> list[int]:
        """``ids`` (layer-major over [first_block, end_block)) with ``SKIP`` for blocks the
        device holds already."""
        if not self.resident_layers:
            return ids
        n = self.end_block - self.first_block
        skip = self.resident_end - self.first_block
        out = list(ids)
        for layer in range(min(self.resident_layers, num_layers)):
            out[layer * n : layer * n + skip] = [SKIP] * skip
        return out

    def trimmed(self, device_blocks: int) -> ReusePlan | None:
        """The plan once ``device_blocks`` leading blocks turned out to be on device:
        spans start there (the first one mid-chunk if need be). None when nothing is left
        to load or a gap opened (the device lost blocks the plan counted on)."""
        if device_blocks < self.first_block or device_blocks >= self.end_block:
            return None
        spans = []
        for s in self.spans:
            if s.end_block <= device_blocks:
                continue
            if s.first_block < device_blocks:
                cut = device_blocks - s.first_block
                per_block = s.nbytes // s.use_blocks if s.use_blocks else 0
                s = KVSpan(s.chunk_hash, device_blocks, s.use_blocks - cut, s.tier,
                             s.nbytes - cut * per_block)
            spans.append(s)
        return ReusePlan(tuple(spans), self.lease_id, device_blocks, self.end_block)
