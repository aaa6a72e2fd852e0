"""The same-node data path between the kvstore's tiers and the engine's KV pool.

    engine ──AttachPool(geometry)──► map the shm file (CPU) / IPC handle (CUDA)  attach.py
    end of a turn ──SaveFromPool──► pool blocks ─gather─► chunk blobs ─► DRAM   save.py
                                     └► write-behind SSD/S3 ─► manifest (ManifestStore)
    next turn ──LookupPrefix──► longest stored prefix, leased                   lookup.py
              (with a peer: local tiers, then the peer, then S3)            ../peers/
              ──LoadIntoPool──► chunks ─scatter─► pool blocks, layer by layer    load.py
    a dropped call ──FencePoolOp──► returns once it can no longer touch the pool fences.py

``EnginePoolPath`` is what the gRPC service calls; each step lives in the module named.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator

from services.kvstore.bandwidth import TierBandwidth
from services.kvstore.engine_path.attach import MappedPool, PoolError, PoolGeometry, PoolRegistry
from services.kvstore.engine_path.copies import lazy_torch
from services.kvstore.engine_path.fences import PoolOps
from services.kvstore.engine_path.leases import Lease, LeaseTable
from services.kvstore.engine_path.load import PEER, load_layers
from services.kvstore.engine_path.lookup import Known, find_stored_prefix, known_sequences
from services.kvstore.engine_path.save import save_from_pool
from services.kvstore.engine_path.types import (
    FindRequest,
    FoundOnPeer,
    LayerLoaded,
    LoadRequest,
    LookupRequest,
    SaveRequest,
    SaveResult,
)
from services.kvstore.manifests import ManifestStore
from services.kvstore.peers.fetch import PeerFetch
from services.kvstore.peers.find import answer_peer, ask_peer, release_quietly
from services.kvstore.peers.links import PeerLinks, PulledKeys
from services.kvstore.store import TieredStore
from services.kvstore.tiers.base import Blob
from shared.chunk_codec import chunk_key
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
        remote_readahead_layers: int = 1,
        drain_s: float = 5.0,
        manifests: ManifestStore | None = None,
        peer_wait_s: float = 2.0,
        peer_timeout_s: float = 10.0,
        peer_bytes_per_s: float = 3e8,
        debug_save_delay_s: float = 0.0,
    ) -> None:
        """``manifests``: the node's manifest store (the gRPC service shares it); without
        one the path makes and owns its own (tests, a pool path on its own). ``peer_*``:
        see ``kvstore.peer_wait_s``, ``peer_timeout_s`` and ``peer_bytes_per_s``."""
        self.store = store
        self._own_manifests = manifests is None
        self.manifests = manifests if manifests is not None else ManifestStore(store, drain_s)
        self.pools = PoolRegistry(chunk_tokens)
        self.ops = PoolOps()  # saves and loads that may still touch a pool (FencePoolOp)
        self.leases = LeaseTable(lease_s, store.unpin)
        self.leases.on_change = store.metrics.active_leases.set
        self.bandwidth = TierBandwidth([t.name for t in store.tiers])
        self.readahead_layers = readahead_layers
        self.remote_readahead_layers = remote_readahead_layers
        self.drain_s = drain_s
        self.links = PeerLinks(peer_bytes_per_s)
        self.peer_wait_s = peer_wait_s
        self.peer_timeout_s = peer_timeout_s
        self.debug_save_delay_s = debug_save_delay_s
        self.data_port = 0  # this node's ChunkServer's port, once started
        # Chunks loaded from a peer: the turn's save keeps them here, not in S3 again.
        self.pulled = PulledKeys()

    async def __aenter__(self) -> EnginePoolPath:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Let pending manifests finish (its own manifest store: up to drain_s), end leases,
        unmap the pools."""
        if self._own_manifests:
            await self.manifests.__aexit__(*exc)
        self.leases.close()
        await self.links.close()
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
            if self.debug_save_delay_s:
                await asyncio.sleep(self.debug_save_delay_s)
            return await save_from_pool(self.store, self.manifests, self.pools, req,
                                        self.pulled)
        finally:
            self.ops.end(req.op_id)

    # ---------------------------------------------------------------- lookup

    async def lookup(self, req: LookupRequest) -> StoredPrefix:
        """The longest stored prefix of ``req``'s prompt, leased. With a peer (the node that
        served the session's last turn), in order of speed: this node's DRAM and SSD, then
        the peer (its chunks start streaming in at once), then the shared S3 tier."""
        pool = self._pool_for_model(req.model_fp)
        g = pool.geometry
        bpc = self.pools.blocks_per_chunk(g.block_size)
        pool.check_model(req.model_fp, req.num_layers)
        if req.whole_session:
            req = await self._session_prompt(req, bpc)
        if req.first_block > len(req.block_hashes):
            raise PoolError(
                f"first_block {req.first_block} is past the {len(req.block_hashes)} block hashes"
            )
        lease = Lease("")
        try:
            matched, spans = await self._find(req, bpc, g.block_size, g.block_bytes, lease)
        except BaseException:
            LeaseTable.abandon(lease, self.store.unpin)
            raise
        lease_id = ""
        if spans:
            lease_id = self.leases.grant(lease)
        else:
            LeaseTable.abandon(lease, self.store.unpin)
        m = self.store.metrics
        m.lookup_blocks.labels("hit").inc(matched - req.first_block)
        m.lookup_blocks.labels("miss").inc(len(req.block_hashes) - matched)
        bandwidth = self.bandwidth.snapshot()
        if req.peer_address:
            bandwidth[PEER] = self.links.bytes_per_s(req.peer_address)
        return StoredPrefix(matched, spans, lease_id, bandwidth,
                            req.block_hashes if req.whole_session else ())

    async def _session_prompt(self, req: LookupRequest, bpc: int) -> LookupRequest:
        """A whole-session lookup (an advised prefetch into the device) as a prompt: the
        session's latest sequence saved here, else its manifest's (empty: none known)."""
        if req.block_hashes or req.first_block or not req.session_id:
            raise PoolError("a whole-session lookup names a session and no block hashes")
        known = await known_sequences(self.manifests, req.tenant, req.session_id,
                                      req.model_fp, bpc)
        hashes = max(known.seqs, key=len, default=())
        return dataclasses.replace(req, block_hashes=hashes)

    async def _find(
        self, req: LookupRequest, bpc: int, block_size: int, block_bytes: int, lease: Lease
    ) -> tuple[int, list[KVSpan]]:
        store, total = self.store, len(req.block_hashes)

        async def search(first: int, last_tier: int | None, known: Known
                         ) -> tuple[int, list[KVSpan]]:
            matched, found = await find_stored_prefix(
                store, req.tenant, req.model_fp, req.block_hashes, first, req.num_layers,
                bpc, known.seqs, lease, last_tier, known.durable,
            )
            spans = [KVSpan(c.chunk_hashes[-1], start, c.use_end - start,
                            store.tiers[t].name, (c.use_end - start) * block_bytes
                            * req.num_layers)
                     for c, start, t in found if c.use_end > start]
            return matched, spans

        if not req.peer_address:
            known = await known_sequences(self.manifests, req.tenant, req.session_id,
                                          req.model_fp, bpc)
            return await search(req.first_block, None, known)
        # The peer served the last turn: this node's own copies (its memory of the session
        # only: the peer knows better than a manifest), then the peer, then S3 only if the
        # peer fell short of the turn's saved length (past it, nobody saved anything more).
        shared = store.lowest_shared
        latest = await known_sequences(self.manifests, req.tenant, req.session_id,
                                       req.model_fp, bpc, manifest=False)
        matched, spans = await search(req.first_block, len(store.tiers) - 2 if shared else None,
                                      latest)
        saved = (req.peer_wait_tokens - 1) // block_size if req.peer_wait_tokens else total
        enough = min(total, saved)
        answered = False
        if matched < enough:
            matched, pulled, answered = await self._from_peer(req, matched, bpc, block_size,
                                                              block_bytes, lease)
            spans += pulled
        if shared and matched < total and not (answered and matched >= enough):
            durable = await known_sequences(self.manifests, req.tenant, req.session_id,
                                            req.model_fp, bpc, durable=True)
            matched, more = await search(matched, None, durable)
            spans += more
        return matched, spans

    async def _from_peer(
        self, req: LookupRequest, first: int, bpc: int, bs: int, block_bytes: int,
        lease: Lease,
    ) -> tuple[int, list[KVSpan], bool]:
        """What the peer holds from block ``first`` on (its pull started into ``lease``),
        and whether it answered."""
        wait = (req.peer_wait_tokens - 1) // bs * bs if req.peer_wait_tokens else 0
        ask = FindRequest(req.tenant, req.session_id, req.model_fp, req.block_hashes, first,
                          req.num_layers, bpc, wait)
        answer = await ask_peer(self.links, req.peer_address, ask,
                                self.peer_wait_s + self.peer_timeout_s)
        m = self.store.metrics.peer_lookups
        if answer is None:
            m.labels("error").inc()
            return first, [], False
        if answer.chunks and not answer.data_port:  # (a peer without a data port)
            log.warning("peer %s holds the prefix but serves no chunk stream",
                        req.peer_address)
            await release_quietly(self.links, req.peer_address, answer.lease_id,
                                  self.peer_timeout_s)
            m.labels("error").inc()
            return first, [], False
        m.labels("hit" if answer.chunks else "miss").inc()
        if not answer.chunks:
            log.info("peer %s holds nothing of the session past block %d (asked for %d "
                     "tokens saved)", req.peer_address, first, wait)
            return first, [], True
        keys: list[list[str]] = [[] for _ in range(req.num_layers)]
        spans = []
        for c in answer.chunks:
            for layer in range(req.num_layers):
                key = chunk_key(req.tenant, req.model_fp, c.chunk_hashes[-1], layer)
                keys[layer].append(key)
                lease.expected[key] = c.chunk_hashes
            spans.append(KVSpan(c.chunk_hashes[-1], c.first_block, c.use_blocks, PEER,
                                c.use_blocks * block_bytes * req.num_layers))
        expected = {k: lease.expected[k] for layer_keys in keys for k in layer_keys}
        lease.fetch = PeerFetch(self.store.metrics, self.links, req.peer_address,
                                answer.lease_id, keys, expected, self.peer_timeout_s,
                                answer.data_port)
        lease.fetch.start()
        return answer.matched_blocks, spans, True

    async def answer_peer(self, req: FindRequest) -> FoundOnPeer:
        """FindPrefix: what this node holds of a peer's prompt (see ``peers/find.py``)."""
        return await answer_peer(self.store, self.manifests, self.leases, req, self.peer_wait_s,
                                 self.data_port)

    def held_blobs(self, lease_id: str) -> dict[str, Blob]:
        """The DRAM copies lease ``lease_id`` holds (empty for none or an ended lease)."""
        lease = self.leases.get(lease_id) if lease_id else None
        return dict(lease.blobs) if lease is not None else {}

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
        lease = None
        try:
            pool = self.pools.get(req.pool_id)
            bpc = self.pools.blocks_per_chunk(pool.geometry.block_size)
            lease = self.leases.hold(req.lease_id)
            async with contextlib.aclosing(load_layers(
                self.store, pool, req, bpc, lease, self.bandwidth, self.readahead_layers,
                self.remote_readahead_layers,
            )) as layers:
                async for msg in layers:
                    yield msg
        finally:
            self.ops.end(req.op_id)
            if lease is not None and lease.fetch is not None:
                self.pulled.add(lease.fetch.keys[: lease.fetch.next_layer])
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
