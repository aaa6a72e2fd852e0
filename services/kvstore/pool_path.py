"""The same-node data path between the kvstore's tiers and the engine's KV pool.

    engine ──AttachPool(geometry)──► map the shm file (CPU) / IPC handle (CUDA)
    end of a turn ──SaveFromPool──► pool blocks ─gather─► chunk blobs ─► DRAM (reply)
                                     └► write-behind SSD/S3 ─► manifest (background)
    next turn ──LookupPrefix──► longest stored prefix, leased (prefix_lookup.py)
              ──LoadIntoPool──► chunks ─scatter─► pool blocks, layer by layer (pool_load.py)

Save contract (SaveFromPool): ``block_ids[layer * n + i]`` holds sequence block
``first_block + i`` (n = len(block_hashes) - first_block), and ``first_block`` is a
multiple of blocks_per_chunk (AttachPool's reply): a chunk can only be built from blocks
this call names. The reply comes once every new chunk is in DRAM, so the engine can unpin.

    blocks:   0 ........ 31 | 32 .... 47 | 48 49        (bpc = 16, first_block = 32)
    chunks:   (saved before)| chunk 2     | chunk 3 (partial, keyed by h49)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator

from services.kvstore.bandwidth import TierBandwidth
from services.kvstore.errors import ManifestIncomplete, TierUnavailable
from services.kvstore.leases import Lease, LeaseTable
from services.kvstore.manifest import Manifest
from services.kvstore.pool_io import encode_from_pool, lazy_torch, to_the_end
from services.kvstore.pool_load import load_layers
from services.kvstore.pool_map import MappedPool, PoolError, PoolGeometry, PoolRegistry
from services.kvstore.pool_ops import PoolOps
from services.kvstore.pool_types import (
    LayerLoaded,
    LoadRequest,
    LookupRequest,
    LookupResult,
    PrefixSpan,
    SavedSequence,
    SaveRequest,
    SaveResult,
)
from services.kvstore.prefix_lookup import find_prefix
from services.kvstore.store import TieredStore
from shared.chunk_codec import ChunkFormatError, ChunkMeta, chunk_key

log = logging.getLogger(__name__)

# Sessions whose latest saved sequence is remembered in memory, and their block hashes in
# all (~60 bytes each): the least recently saved are forgotten first; their lookups then
# read the durable manifest instead.
LATEST_SESSIONS = 10_000
LATEST_HASHES = 1 << 20


class PoolDataPath:
    """AttachPool, SaveFromPool, LookupPrefix, LoadIntoPool, ReleaseLease over one store."""

    def __init__(
        self,
        store: TieredStore,
        chunk_tokens: int,
        lease_s: float = 30.0,
        readahead_layers: int = 1,
        drain_s: float = 5.0,
    ) -> None:
        self.store = store
        self.pools = PoolRegistry(chunk_tokens)
        self.ops = PoolOps()  # saves and loads that may still touch a pool (FencePoolOp)
        self.leases = LeaseTable(lease_s, store.unpin)
        self.leases.on_change = store.metrics.active_leases.set
        self.bandwidth = TierBandwidth([t.name for t in store.tiers])
        self.readahead_layers = readahead_layers
        self.drain_s = drain_s
        self._latest: OrderedDict[tuple[str, str], SavedSequence] = OrderedDict()
        self._latest_hashes = 0
        # Per session: the manifest task of its latest sequence, and every manifest task
        # still running (a superseded one that is writing runs to its end).
        self._manifests: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._tasks: dict[tuple[str, str], set[asyncio.Task[None]]] = {}
        self._writing: set[asyncio.Task[None]] = set()  # manifest tasks past their checks
        # Sessions deleted (``forget``) while a save may have been under way: a save that
        # started before the delete must not bring the session back.
        self._forgets = itertools.count(1)
        self._forgotten: OrderedDict[tuple[str, str], int] = OrderedDict()

    async def __aenter__(self) -> PoolDataPath:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Let pending manifests finish (up to drain_s), end leases, unmap the pools."""
        tasks = self._all_tasks()
        if tasks:
            await asyncio.wait(tasks, timeout=self.drain_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._manifests.clear()
        self._tasks.clear()
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
            return await self._save(req)
        finally:
            self.ops.end(req.op_id)

    async def _save(self, req: SaveRequest) -> SaveResult:
        pool = self.pools.get(req.pool_id)
        kv = pool.kv  # keep our view alive for the whole call
        bpc = self.pools.blocks_per_chunk(pool.geometry.block_size)
        nb, fb, layers = len(req.block_hashes), req.first_block, req.num_layers
        pool.check_model(req.model_fp, layers)
        if fb > nb or fb % bpc:
            raise PoolError(
                f"first_block {fb} must be a multiple of blocks_per_chunk {bpc} "
                f"and <= the {nb} block hashes"
            )
        n = nb - fb
        if len(req.block_ids) != layers * n:
            raise PoolError(
                f"block_ids has {len(req.block_ids)} entries; expected num_layers * "
                f"(len(block_hashes) - first_block) = {layers} * {n}"
            )
        pool.check_block_ids(list(req.block_ids))
        # Everything about the request is checked before anything is stored or remembered.
        chunk_key(req.tenant, req.model_fp, b"\0", layers - 1)  # the names (ChunkFormatError)
        sid = (req.tenant, req.session_id)
        manifest = Manifest(
            req.tenant, req.session_id, req.model_fp, req.block_hashes, req.token_count,
            layers, bpc,
        ) if req.session_id and nb else None
        deleted_before = self._forgotten.get(sid)
        jobs: list[tuple[ChunkMeta, list[int]]] = []
        skipped = 0
        for start in range(fb, nb, bpc):
            end = min(start + bpc, nb)
            for layer in range(layers):
                meta = ChunkMeta(req.tenant, req.model_fp, layer, req.block_hashes[start:end])
                if self.store.has_local_or_durable(meta.key):  # validates tenant/model_fp
                    skipped += 1
                    continue
                base = layer * n - fb
                jobs.append((meta, list(req.block_ids[base + start : base + end])))
        # to the end even if the call is dropped: the op ends when the pool reads do
        blobs = await to_the_end(asyncio.to_thread(encode_from_pool, kv, jobs))
        for (meta, ids), blob in zip(jobs, blobs):
            self.store.put_encoded(meta, blob)
            self.store.metrics.pool_bytes_saved.inc(len(ids) * pool.geometry.block_bytes)
        if manifest is not None and self._forgotten.get(sid) == deleted_before:
            # (a session deleted while this save ran stays deleted)
            self._remember(req, manifest)
        return SaveResult(len(jobs), skipped)

    def _remember(self, req: SaveRequest, manifest: Manifest) -> None:
        """The next turn's lookup sees this sequence now; its manifest follows once durable."""
        sid = (req.tenant, req.session_id)
        self._drop_latest(sid)
        self._latest[sid] = SavedSequence(
            req.model_fp, req.block_hashes, req.token_count, req.num_layers
        )
        self._latest_hashes += len(req.block_hashes)
        while len(self._latest) > LATEST_SESSIONS or (
                self._latest_hashes > LATEST_HASHES and len(self._latest) > 1):
            self._drop_latest(next(iter(self._latest)))
        old = self._manifests.pop(sid, None)
        if old is not None and old not in self._writing:
            old.cancel()  # a newer sequence of the session supersedes it
        task = asyncio.create_task(self._write_manifest(manifest, sid), name=f"manifest-{sid[1]}")
        self._manifests[sid] = task
        self._tasks.setdefault(sid, set()).add(task)
        task.add_done_callback(lambda t, k=sid: self._manifest_done(k, t))

    def _drop_latest(self, sid: tuple[str, str]) -> None:
        seq = self._latest.pop(sid, None)
        if seq is not None:
            self._latest_hashes -= len(seq.block_hashes)

    def _manifest_done(self, sid: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._manifests.get(sid) is task:
            del self._manifests[sid]
        live = self._tasks.get(sid)
        if live is not None:
            live.discard(task)
            if not live:
                del self._tasks[sid]

    def _all_tasks(self) -> list[asyncio.Task[None]]:
        return [t for live in self._tasks.values() for t in live]

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session is being deleted: stop offering its latest sequence to lookups, and
        return only when no manifest of it can be written any more (a pending one is
        cancelled; one being written is waited for, so the caller's delete comes after)."""
        sid = (tenant, session_id)
        self._drop_latest(sid)
        self._forgotten[sid] = next(self._forgets)  # a save under way will not remember it
        self._forgotten.move_to_end(sid)
        while len(self._forgotten) > LATEST_SESSIONS:
            self._forgotten.popitem(last=False)
        self._manifests.pop(sid, None)
        tasks = list(self._tasks.get(sid, ()))
        for task in tasks:
            if task not in self._writing:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _write_manifest(self, manifest: Manifest, sid: tuple[str, str]) -> None:
        me = asyncio.current_task()
        try:
            await self.store.wait_durable(manifest)
            if self._manifests.get(sid) is not me:
                return  # superseded, or the session was deleted meanwhile
            assert me is not None
            self._writing.add(me)  # from here on it is not cancelled: its put must land
            try:
                # An older manifest of the session still being written lands first, so the
                # newest is the one that stays; then check again that this one is wanted.
                older = [t for t in self._tasks.get(sid, ()) if t is not me and t in self._writing]
                if older:
                    await asyncio.gather(*older, return_exceptions=True)
                    if self._manifests.get(sid) is not me:
                        return
                await self.store.write_manifest(manifest)
            finally:
                self._writing.discard(me)
        except (ManifestIncomplete, TierUnavailable, ChunkFormatError) as e:
            log.warning("manifest of %s not written: %s", manifest.key, e)

    async def wait_manifests(self) -> None:
        """Wait for the background manifest writes pending now (tests, shutdown)."""
        await asyncio.gather(*self._all_tasks(), return_exceptions=True)

    # ---------------------------------------------------------------- lookup

    async def _known_sequences(self, req: LookupRequest, bpc: int) -> list[tuple[bytes, ...]]:
        if not req.session_id:
            return []
        latest = self._latest.get((req.tenant, req.session_id))
        if latest is not None and latest.model_fp == req.model_fp:
            return [latest.block_hashes]
        m = await self.store.get_manifest(req.tenant, req.session_id)
        if m is not None and m.model_fp == req.model_fp and m.blocks_per_chunk == bpc:
            return [m.block_hashes]
        return []

    async def lookup(self, req: LookupRequest) -> LookupResult:
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
                spans.append(PrefixSpan(
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
        return LookupResult(matched, spans, lease_id, self.bandwidth.snapshot())

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    # ---------------------------------------------------------------- load

    async def load(self, req: LoadRequest) -> AsyncIterator[LayerLoaded]:
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

    async def fence(self, op_id: str) -> None:
        """Return once the save or load ``op_id`` can no longer touch its pool."""
        await self.ops.fence(op_id)

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        self.leases.check_integrity()
