"""What LoadIntoPool checks: the request against the pool, and each chunk against the
span and layer it is read for (key, header hashes, payload shape and dtype).

A chunk that fails a check is a failed layer (the engine recomputes it), never data
copied into a pool block that the request did not name.
"""

from __future__ import annotations

from services.kvstore.engine_path.attach import MappedPool, PoolError
from services.kvstore.engine_path.copies import SKIP
from services.kvstore.engine_path.types import LoadRequest
from shared.chunk_codec import Chunk, ChunkMeta, chunk_key
from shared.kv_layout import KVSpan


class LoadFailed(Exception):
    """One layer cannot be loaded (miss, corrupt, mismatch): the engine recomputes."""


def check_request(pool: MappedPool, req: LoadRequest, bpc: int) -> int:
    if not req.spans:
        raise PoolError("LoadIntoPool needs at least one span")
    pool.check_model(req.model_fp, req.num_layers)
    for s in req.spans:
        off = s.first_block % bpc
        if s.use_blocks < 1 or off + s.use_blocks > bpc or not s.chunk_hash:
            raise PoolError(
                f"span at block {s.first_block} with {s.use_blocks} blocks does not fit one "
                f"chunk of {bpc} blocks"
            )
    n = sum(s.use_blocks for s in req.spans)
    if len(req.block_ids) != req.num_layers * n:
        raise PoolError(
            f"block_ids has {len(req.block_ids)} entries; expected num_layers * "
            f"sum(use_blocks) = {req.num_layers} * {n}"
        )
    ids = [b for b in req.block_ids if b != SKIP]  # SKIP: already on device
    pool.check_block_ids(ids)
    if len(set(ids)) != len(ids):
        # Two reads into one block would make a sound chunk fail its checksum there.
        raise PoolError("block_ids repeat a block: every loaded block needs its own")
    return n


def key_prefixes(req: LoadRequest) -> dict[bytes, str]:
    """Chunk hash -> its key without the layer: ``chunk_key`` checks the fields once per
    request instead of once per chunk and layer."""
    return {s.chunk_hash: chunk_key(req.tenant, req.model_fp, s.chunk_hash, 0)[:-1]
            for s in req.spans}


def check_chunk(
    meta: ChunkMeta, shape: tuple[int, ...], dtype: str, req: LoadRequest, span: KVSpan,
    layer: int, pool: MappedPool, bpc: int, expected: tuple[bytes, ...] | None,
) -> None:
    """A chunk (its header: ``meta``, payload ``shape`` and ``dtype`` name) is the one the
    request wants for ``span`` in ``layer``, shaped as the pool's blocks."""
    g = pool.geometry
    hashes = meta.block_hashes
    off = span.first_block % bpc
    if (meta.tenant, meta.model_fp, meta.layer) != (req.tenant, req.model_fp, layer):
        raise LoadFailed(f"layer {layer}: chunk header names another tenant/model/layer")
    if hashes[-1] != span.chunk_hash or len(hashes) > bpc or len(hashes) < off + span.use_blocks:
        raise LoadFailed(f"layer {layer}: chunk at block {span.first_block} does not hold the span")
    if expected is not None and hashes != expected:
        raise LoadFailed(f"layer {layer}: chunk hashes differ from the lookup's")
    want = (len(hashes), 2, g.block_size, g.num_kv_heads, g.head_dim)
    if shape != want or dtype != g.dtype:
        raise LoadFailed(
            f"layer {layer}: chunk is {shape} {dtype}, the pool wants {want} {g.dtype}"
        )


def check_decoded(chunk: Chunk, req: LoadRequest, span: KVSpan, layer: int,
                   pool: MappedPool, bpc: int, expected: tuple[bytes, ...] | None) -> None:
    check_chunk(chunk.meta, tuple(chunk.tensor.shape),
                 str(chunk.tensor.dtype).removeprefix("torch."), req, span, layer, pool, bpc,
                 expected)
