"""Before a request enters the core: what of its prompt to load from the kvstore (event loop).

    prompt tokens ──hash──► h_0 .. h_{m-1}          m = (n - 1) // block_size full blocks
                                                    (the last token is always computed)
    a device prefetch of h_0 under way ──join──►   wait for it (bounded), not load twice
    device prefix cache ──peek──► D blocks on device (a hint; admission re-checks)
    find_stored_prefix(first_block=D) ──► spans over [D, matched), tier bandwidths, lease
        (with the request's kv_source: the kvstore searches the peer that served the
        session's last turn too, and the spans it holds there stream in from it)
    choose_spans ──► the longest prefix of spans worth loading (or none: release the lease)

A lookup that fails or times out means "nothing stored": the request recomputes.
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.engine.api_types import EngineStatus
from services.engine.config import EngineConfig
from services.engine.offload.cost_model import RECOMPUTE, choose_spans
from services.engine.offload.prefetch_joins import PrefetchJoins
from services.engine.reuse_plan import ReusePlan
from services.engine.validation import PreparedRequest
from shared.hashing import block_hashes
from shared.kv_layout import KVSpan, StoredPrefix
from shared.session_key import SessionKey

log = logging.getLogger(__name__)


class StoredPrefixes(Protocol):
    """The node's kvstore as the planner asks it (``KVStoreClient``)."""

    @property
    def attached(self) -> bool: ...

    async def find_stored_prefix(self, session: SessionKey, hashes: list[bytes],
                                 first_block: int, peer: str = "", peer_tokens: int = 0
                                 ) -> StoredPrefix | None: ...

    def release(self, lease_id: str) -> None: ...


class CachedPrefix(Protocol):
    """The device prefix cache's peek (``BlockTables``): a dict read, safe from the loop,
    and only a hint (admission looks again on the worker)."""

    def peek_cached_blocks(self, hashes: list[bytes]) -> int: ...


class StepSnapshots(Protocol):
    """The engine's counters after its last step, as the event loop holds them (the
    worker publishes them with each step's outputs): the measured prefill cost."""

    @property
    def snapshot(self) -> EngineStatus | None: ...


def contiguous(spans: list[KVSpan], first_block: int) -> list[KVSpan]:
    """The leading spans that continue each other from ``first_block`` without a gap."""
    out = []
    at = first_block
    for s in spans:
        if s.first_block != at or s.use_blocks <= 0:
            break
        out.append(s)
        at = s.end_block
    return out


class ReusePlanner:
    def __init__(self, config: EngineConfig, store: StoredPrefixes, device: CachedPrefix,
                 joins: PrefetchJoins, steps: StepSnapshots, num_layers: int) -> None:
        self.config = config
        self.store = store
        self.device = device
        self.joins = joins
        self.steps = steps
        self.num_layers = num_layers

    async def plan(self, req: PreparedRequest) -> ReusePlan | None:
        """The prefix to load for ``req``, or None (device hit only / recompute)."""
        if self.config.offload.mode == RECOMPUTE or not self.store.attached:
            return None
        bs = self.config.block_size
        ids = req.prompt_token_ids
        m = (len(ids) - 1) // bs
        if m == 0:
            return None
        hashes = block_hashes(ids[: m * bs], bs, req.hash_seed)
        # An advisory's load of this prefix into the device is under way: wait for it
        # (bounded by ``offload.prefetch_join_s``) rather than load the same KV twice.
        await self.joins.join(hashes[0], self.config.offload.prefetch_join_s)
        device = self.device.peek_cached_blocks(hashes)
        if device >= m:
            return None
        answer = await self.store.find_stored_prefix(
            SessionKey(req.tenant, req.session_id), hashes, device, req.kv_source,
            req.kv_source_tokens)
        if answer is None:
            return None
        spans = contiguous(answer.spans, device)
        keep = self._choose(spans, len(ids), device, answer.tier_bytes_per_s)
        if keep == 0:
            self.store.release(answer.lease_id)
            return None
        chosen = tuple(spans[:keep])
        return ReusePlan(chosen, answer.lease_id, device, chosen[-1].end_block)

    def release(self, plan: ReusePlan) -> None:
        """A plan that will not be used: give its lease back."""
        self.store.release(plan.lease_id)

    def _seconds_per_token(self) -> float:
        snap = self.steps.snapshot
        if snap is None:
            return self.config.offload.prefill_s_per_token
        return snap.reuse.prefill_s_per_token

    def _choose(
        self, spans: list[KVSpan], prompt_tokens: int, device: int, bw: dict[str, float]
    ) -> int:
        if not spans or self.config.offload.policy == "always":
            return len(spans)
        est = choose_spans(
            spans,
            prompt_tokens=prompt_tokens,
            device_tokens=device * self.config.block_size,
            block_size=self.config.block_size,
            tier_bytes_per_s=bw,
            seconds_per_token=self._seconds_per_token(),
            num_layers=self.num_layers,
            mode=self.config.offload.mode,
            overhead_s=self.config.offload.load_overhead_s,
        )
        if est.spans < len(spans):
            log.debug("loading %d of %d stored spans (est. %.4f s vs recompute %.4f s)",
                      est.spans, len(spans), est.seconds, est.recompute_seconds)
        return est.spans
