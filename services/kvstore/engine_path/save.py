"""SaveFromPool: a sequence's pool blocks into chunks in DRAM; its manifest follows.

Save contract: ``block_ids[layer * n + i]`` holds sequence block ``first_block + i``
(n = len(block_hashes) - first_block), and ``first_block`` is a multiple of
blocks_per_chunk (AttachPool's reply): a chunk can only be built from blocks this call
names. The reply comes once every new chunk is in DRAM, so the engine can unpin.

    blocks:   0 ........ 31 | 32 .... 47 | 48 49        (bpc = 16, first_block = 32)
    chunks:   (saved before)| chunk 2     | chunk 3 (partial, keyed by h49)

Chunks already held (locally, in flight, or vouched durable) are skipped without a copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container

from services.kvstore.engine_path.attach import MappedPool, PoolError, PoolRegistry
from services.kvstore.engine_path.copies import encode_from_pool, to_the_end
from services.kvstore.engine_path.types import SaveRequest, SaveResult
from services.kvstore.manifests import Manifest, ManifestStore, manifest_key
from services.kvstore.manifests.latest import SavedSequence
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.store import TieredStore
from shared.chunk_codec import ChunkMeta, chunk_key
from shared.session_key import SessionKey


async def save_from_pool(
    store: TieredStore, manifests: ManifestStore, pools: PoolRegistry, req: SaveRequest,
    pulled: Container[str] = (),
) -> SaveResult:
    """Store ``req``'s new chunks in DRAM (written behind below) and remember the sequence
    for the session. Chunks in ``pulled`` (loaded from a peer, which writes them to the
    shared tier) skip that tier. Raises ``PoolError``/``ChunkFormatError`` before storing
    anything."""
    pool = pools.get(req.pool_id)
    bpc = pools.blocks_per_chunk(pool.geometry.block_size)
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
    session = scoped_session(req.session_id, req.model_fp)
    if session:
        manifest_key(req.tenant, session)  # (ChunkFormatError)
    sid = SessionKey(req.tenant, session)
    if not (req.session_id and nb):
        return await _save_chunks(store, pool, req, bpc, pulled)
    with manifests.saves.saving(sid):  # a peer asking for this session waits for us
        result = await _save_chunks(store, pool, req, bpc, pulled, manifests)
    manifests.saves.saved(sid, req.token_count, pool.geometry.block_size)
    return result


async def _save_chunks(
    store: TieredStore, pool: MappedPool, req: SaveRequest, bpc: int, pulled: Container[str],
    manifests: ManifestStore | None = None,
) -> SaveResult:
    """Encode and admit the new chunks; with ``manifests``, remember the sequence."""
    kv = pool.kv  # keep our view alive for the whole call
    nb, fb, layers = len(req.block_hashes), req.first_block, req.num_layers
    n = nb - fb
    sid = (req.tenant, scoped_session(req.session_id, req.model_fp))
    deleted_before = manifests.deletions(*sid) if manifests is not None else None
    jobs: list[tuple[ChunkMeta, list[int]]] = []
    skipped = 0
    for start in range(fb, nb, bpc):
        end = min(start + bpc, nb)
        for layer in range(layers):
            meta = ChunkMeta(req.tenant, req.model_fp, layer, req.block_hashes[start:end])
            if store.has_local_or_durable(meta.key):  # validates tenant/model_fp
                skipped += 1
                continue
            base = layer * n - fb
            jobs.append((meta, list(req.block_ids[base + start : base + end])))
    # to the end even if the call is dropped: the op ends when the pool reads do
    blobs = await to_the_end(asyncio.to_thread(encode_from_pool, kv, jobs))
    for (meta, ids), blob in zip(jobs, blobs, strict=False):
        store.put_encoded(meta, blob, copy_of_shared=meta.key in pulled)
        store.metrics.pool_bytes_saved.inc(len(ids) * pool.geometry.block_bytes)
    if manifests is not None:  # (a session deleted while this save ran stays deleted)
        manifest = Manifest(
            req.tenant, sid[1], req.model_fp, req.block_hashes, req.token_count,
            layers, bpc, retain_s=manifests.retention.bound(req.retain_s),
        )
        seq = SavedSequence(req.model_fp, req.block_hashes, req.token_count, req.num_layers)
        manifests.remember(seq, manifest, deleted_before)
    return SaveResult(len(jobs), skipped)
