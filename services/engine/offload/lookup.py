"""Before a request enters the core: what of its prompt to load from the kvstore (event loop).

    prompt tokens ──hash──► h_0 .. h_{m-1}          m = (n - 1) // block_size full blocks
                                                    (the last token is always computed)
    device prefix cache ──peek──► D blocks on device (a hint; admission re-checks)
    LookupPrefix(first_block=D) ──► spans over [D, matched), tier bandwidths, lease
        (with the request's kv_source: the kvstore searches the peer that served the
        session's last turn too, and the spans it holds there stream in from it)
    choose_spans ──► the longest prefix of spans worth loading (or none: release the lease)

A lookup that fails or times out means "nothing stored": the request recomputes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.engine.config import EngineConfig
from services.engine.kvcache.block_tables import BlockTables
from services.engine.offload.jobs import PoolGeometry
from services.engine.offload.kvstore_client import KVStoreClient, LoopTransport
from services.engine.offload.kvstore_offload import KVStoreOffload, offload_for
from services.engine.offload.planner import RECOMPUTE, ReusePlan, choose_spans
from services.engine.validation import PreparedRequest
from shared.hashing import block_hashes
from shared.kv_layout import KVSpan

if TYPE_CHECKING:
    from services.engine.engine_core import EngineCore
    from services.engine.model import ModelConfig

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.002


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


class PrefixLookup:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVStoreClient,
        kv: BlockTables,
        reuse: KVStoreOffload,
        num_layers: int,
    ) -> None:
        self.config = config
        self.connector = connector
        self.kv = kv
        self.reuse = reuse
        self.num_layers = num_layers

    async def plan(self, req: PreparedRequest) -> ReusePlan | None:
        """The prefix to load for ``req``, or None (device hit only / recompute)."""
        if self.config.offload.mode == RECOMPUTE or not self.connector.attached:
            return None
        bs = self.config.block_size
        ids = req.prompt_token_ids
        m = (len(ids) - 1) // bs
        if m == 0:
            return None
        hashes = block_hashes(ids[: m * bs], bs, req.hash_seed)
        if hashes[0] in self.reuse.prefetch.in_flight:
            await self._join_prefetch(hashes[0])
        device = self.kv.peek_cached_blocks(hashes)
        if device >= m:
            return None
        answer = await self.connector.lookup(req.tenant, req.session_id, hashes, device,
                                             req.kv_source, req.kv_source_tokens)
        if answer is None:
            return None
        spans = contiguous(answer.spans, device)
        keep = self._choose(spans, len(ids), device, answer.tier_bytes_per_s)
        if keep == 0:
            self.connector.release(answer.lease_id)
            return None
        chosen = tuple(spans[:keep])
        return ReusePlan(chosen, answer.lease_id, device, chosen[-1].end_block)

    async def _join_prefetch(self, first_hash: bytes) -> None:
        """An advisory's load into the device of this prefix is under way: wait for it
        (bounded by ``offload.prefetch_join_s``) rather than load the same KV twice."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.offload.prefetch_join_s
        while first_hash in self.reuse.prefetch.in_flight and loop.time() < deadline:
            await asyncio.sleep(JOIN_POLL_S)

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
            seconds_per_token=self.reuse.prefill_rate.value,
            num_layers=self.num_layers,
            mode=self.config.offload.mode,
            overhead_s=self.config.offload.load_overhead_s,
        )
        if est.spans < len(spans):
            log.debug("loading %d of %d stored spans (est. %.4f s vs recompute %.4f s)",
                      est.spans, len(spans), est.seconds, est.recompute_seconds)
        return est.spans


async def connect_offload(
    config: EngineConfig,
    core: EngineCore,
    model: ModelConfig,
    unpin: Callable[[int | None, bool], None],
) -> tuple[KVStoreClient, PrefixLookup]:
    """Start a connector for ``core``'s pool (attaching in the background), give the core
    its transport, and return the connector with the coordinator that plans loads.
    ``unpin(job_id, ok)`` must route to the worker (None: just wake it; ``ok``: the save
    stored its chunks)."""
    geometry = PoolGeometry(
        pool_name=core.pool.name, device=config.device, num_blocks=core.pool.num_blocks,
        block_size=config.block_size, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        dtype=core.model_info.dtype, num_layers=model.num_layers,
        model_fp=core.model_info.fingerprint,
    )
    connector = KVStoreClient(config, geometry)
    # An int written on the loop, read by the worker: where mid-generation saves may cut.
    offload = offload_for(config, core.kv, core.scheduler, core.pool.block_bytes)
    connector.on_attached = lambda bpc: setattr(offload, "blocks_per_chunk", bpc)
    await connector.start()
    offload.transport = LoopTransport(asyncio.get_running_loop(), connector, unpin)
    core.offload = offload  # before the step loop starts: the worker is idle
    coordinator = PrefixLookup(config, connector, core.kv, offload, model.num_layers)
    return connector, coordinator
