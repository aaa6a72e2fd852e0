"""The same-node data path between the kvstore's tiers and the engine's KV pool.

    engine ──AttachPool(geometry)──► map the shm file (CPU) / IPC handle (CUDA)  attach.py
    end of a turn ──SaveFromPool──► pool blocks ─gather─► chunk blobs ─► DRAM   save.py
                                     └► write-behind SSD/S3 ─► manifest (ManifestStore)
    next turn ──LookupPrefix──► longest stored prefix, leased                   lookup.py
              ──LoadIntoPool──► chunks ─scatter─► pool blocks, layer by layer    load.py
    a dropped call ──FencePoolOp──► returns once it can no longer touch the pool fences.py

``EnginePoolPath`` is what the gRPC service calls; each step lives in the module named.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from services.kvstore.bandwidth import TierBandwidth
from services.kvstore.manifests import ManifestStore
from services.kvstore.pool.attach import MappedPool, PoolError, PoolGeometry, PoolRegistry
from services.kvstore.pool.copies import lazy_torch
from services.kvstore.pool.fences import PoolOps
from services.kvstore.pool.leases import Lease, LeaseTable
from services.kvstore.pool.load import load_layers
from services.kvstore.pool.lookup import find_prefix
from services.kvstore.pool.save import save_from_pool
from services.kvstore.pool.types import (
    LayerLoaded,
    LoadRequest,
    LookupRequest,
    SaveRequest,
    SaveResult,
)
from services.kvstore.store import TieredStore
from shared.kv_layout import KVSpan, StoredPrefix

log = logging.getLogger(__name__)


class EnginePoolPath:
    """AttachPool, SaveFromPool, LookupPrefix, LoadIntoPool, ReleaseLease over one store."""

    def __init__(
        self,
        store: TieredStore,
        chunk_tokens: int,
        lease_s: float = 30.0,
        readahead_layers: int = 1,
        drain_s: float = 5.0,
        manifests: ManifestStore | None = None,
    ) -> None:
        """``manifests``: the node's manifest store (the gRPC service shares it); without
        one the path makes and owns its own (tests, a pool path on its own)."""
        self.store = store
        self._own_manifests = manifests is None
        self.manifests = manifests if manifests is not None else ManifestStore(store, drain_s)
        self.pools = PoolRegistry(chunk_tokens)
        self.ops = PoolOps()  # saves and loads that may still touch a pool (FencePoolOp)
        self.leases = LeaseTable(lease_s, store.unpin)
        self.leases.on_change = store.metrics.active_leases.set
        self.bandwidth = TierBandwidth([t.name for t in store.tiers])
        self.readahead_layers = readahead_layers
        self.drain_s = drain_s

    async def __aenter__(self) -> EnginePoolPath:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Let pending manifests finish (its own manifest store: up to drain_s), end leases,
        unmap the pools."""
        if self._own_manifests:
            await self.manifests.__aexit__(*exc)
        self.leases.close()
        self.pools.close()

    # ---------------------------------------------------------------- attach

    async def attach(self, geometry: PoolGeometry) -> tuple[str, int]:
        """(pool_id, blocks_per_chunk). Raises ``PoolError``/``ConfigError``."""
        await asyncio.to_thread(lazy_torch)  # the first import takes seconds: off the loop
        pool = self.pools.attach(geometry)
        return pool.pool_id, self.pools.blocks_per_chunk(geometry.block_size)

    def _pool_for_model(self, model_fp: str) -> MappedPool:
        pool = self.pools.by_model(model_fp)
        if pool is not None:
            return pool
        raise PoolError(f"no pool attached for model_fp {model_fp!r}; call AttachPool first")

    # ---------------------------------------------------------------- save

    async def save(self, req: SaveRequest) -> SaveResult:
        self.ops.begin(req.op_id)
        try:
            return await save_from_pool(self.store, self.manifests, self.pools, req)
        finally:
            self.ops.end(req.op_id)

    # ---------------------------------------------------------------- lookup

    async def _known_sequences(self, req: LookupRequest, bpc: int) -> list[tuple[bytes, ...]]:
        if not req.session_id:
            return []
        latest = self.manifests.latest(req.tenant, req.session_id)
        if latest is not None and latest.model_fp == req.model_fp:
            return [latest.block_hashes]
        m = await self.manifests.get_manifest(req.tenant, req.session_id)
        if m is not None and m.model_fp == req.model_fp and m.blocks_per_chunk == bpc:
            return [m.block_hashes]
        return []

    async def lookup(self, req: LookupRequest) -> StoredPrefix:
        pool = self._pool_for_model(req.model_fp)
        g = pool.geometry
        bpc = self.pools.blocks_per_chunk(g.block_size)
        pool.check_model(req.model_fp, req.num_layers)
        if req.first_block > len(req.block_hashes):
            raise PoolError(
                f"first_block {req.first_block} is past the {len(req.block_hashes)} block hashes"
            )
        known = await self._known_sequences(req, bpc)
        lease = Lease("")
        try:
            matched, found = await find_prefix(
                self.store, req.tenant, req.model_fp, req.block_hashes, req.first_block,
                req.num_layers, bpc, known, lease,
            )
        except BaseException:
            LeaseTable.abandon(lease, self.store.unpin)
            raise
        spans = []
        for cand, start, tier_index in found:
            use = cand.use_end - start
            if use > 0:
                spans.append(KVSpan(
                    cand.chunk_hashes[-1], start, use, self.store.tiers[tier_index].name,
                    use * g.block_bytes * req.num_layers,
                ))
        lease_id = ""
        if spans:
            lease_id = self.leases.grant(lease)
        else:
            LeaseTable.abandon(lease, self.store.unpin)
        m = self.store.metrics
        m.lookup_blocks.labels("hit").inc(matched - req.first_block)
        m.lookup_blocks.labels("miss").inc(len(req.block_hashes) - matched)
        return StoredPrefix(matched, spans, lease_id, self.bandwidth.snapshot())

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    # ---------------------------------------------------------------- load

    async def load(self, req: LoadRequest) -> AsyncGenerator[LayerLoaded, None]:
        """Yield one ``LayerLoaded`` per layer, lowest first; stops after a failed layer.

        Raises ``PoolError`` before the first yield for a malformed request. The lease
        (if still live) is used for its held copies and released at the end either way.
        """
        try:
            self.ops.begin(req.op_id)
        except BaseException:  # refused (a fenced or reused op id): nothing will load it
            if req.lease_id:
                self.leases.release(req.lease_id)
            raise
        # aclosing: when the caller drops this stream, the loader's own clean-up (waiting
        # for a read-and-copy under way) runs before we return, not whenever the event
        # loop gets round to finalizing an abandoned generator: no pool write may follow
        # the end of the call (nor the end of its op, which FencePoolOp waits for).
        try:
            pool = self.pools.get(req.pool_id)
            bpc = self.pools.blocks_per_chunk(pool.geometry.block_size)
            async with contextlib.aclosing(load_layers(
                self.store, pool, req, bpc, self.leases.hold(req.lease_id),
                self.bandwidth, self.readahead_layers,
            )) as layers:
                async for msg in layers:
                    yield msg
        finally:
            self.ops.end(req.op_id)
            if req.lease_id:
                self.leases.release(req.lease_id)

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session is being deleted (see ``ManifestStore.forget``)."""
        await self.manifests.forget(tenant, session_id)

    async def wait_manifests(self) -> None:
        """Wait for the background manifest writes pending now (tests, shutdown)."""
        await self.manifests.wait_pending()

    async def fence(self, op_id: str) -> None:
        """Return once the save or load ``op_id`` can no longer touch its pool."""
        await self.ops.fence(op_id)

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        self.leases.check_integrity()
