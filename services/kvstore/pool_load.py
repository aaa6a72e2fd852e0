"""LoadIntoPool: leased chunks into pool blocks, lowest layer first, reads ahead of copies.

    reads:   [layer 0] [layer 1] [layer 2] ...      <= readahead layers in flight
    copies:            [layer 0] [layer 1] ...      one worker-thread copy per layer
    replies:                  L0 ok     L1 ok ...    the engine's layer l may start now

Target blocks are layer-major: span k's blocks of layer l go to
``block_ids[l * n + off_k : l * n + off_k + use_k]`` with n = sum(use) and off_k the sum
of the earlier spans' use. Inside its chunk a span starts at
``first_block % blocks_per_chunk``::

    chunk (bpc = 16):  | 0 1 2 ... 7 | 8 ... 12 | 13 14 15 |
    span first_block=40, use=5:  offset 8 ─┘└─ copies these 5 blocks

Every chunk of a layer is read and checked (key, header hashes, shape, dtype) before any
of that layer is copied, so a failed layer writes nothing; later layers are not loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kvstore.bandwidth import TierBandwidth
from services.kvstore.leases import Lease
from services.kvstore.pool_io import scatter_blocks
from services.kvstore.pool_map import MappedPool, PoolError
from services.kvstore.pool_types import LayerLoaded, LoadRequest, PrefixSpan
from services.kvstore.store import TieredStore
from shared.chunk_codec import Chunk, ChunkCorrupt, chunk_key, decode_chunk

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class LoadFailed(Exception):
    """One layer cannot be loaded (miss, corrupt, mismatch): the engine recomputes."""


@dataclass
class Part:
    tensor: torch.Tensor  # (chunk blocks, 2, bs, kvh, hd)
    offset: int  # first block of the chunk to copy
    ids: list[int]  # target pool blocks
    tier: str
    nbytes: int
    read_s: float


def _check_request(pool: MappedPool, req: LoadRequest, bpc: int) -> int:
    if not req.spans:
        raise PoolError("LoadIntoPool needs at least one span")
    if req.num_layers < 1:
        raise PoolError("num_layers must be >= 1")
    for s in req.spans:
        off = s.first_block % bpc
        if s.use_blocks < 1 or off + s.use_blocks > bpc or not s.chunk_hash:
            raise PoolError(
                f"span at block {s.first_block} with {s.use_blocks} blocks does not fit one "
                f"chunk of {bpc} blocks"
            )
    chunk_key(req.tenant, req.model_fp, req.spans[0].chunk_hash, 0)  # ChunkFormatError if bad
    n = sum(s.use_blocks for s in req.spans)
    if len(req.block_ids) != req.num_layers * n:
        raise PoolError(
            f"block_ids has {len(req.block_ids)} entries; expected num_layers * "
            f"sum(use_blocks) = {req.num_layers} * {n}"
        )
    pool.check_block_ids(list(req.block_ids))
    return n


def _check_chunk(
    chunk: Chunk, req: LoadRequest, span: PrefixSpan, layer: int, pool: MappedPool,
    bpc: int, expected: tuple[bytes, ...] | None,
) -> None:
    m, g = chunk.meta, pool.geometry
    hashes = m.block_hashes
    off = span.first_block % bpc
    if (m.tenant, m.model_fp, m.layer) != (req.tenant, req.model_fp, layer):
        raise LoadFailed(f"layer {layer}: chunk header names another tenant/model/layer")
    if hashes[-1] != span.chunk_hash or len(hashes) > bpc or len(hashes) < off + span.use_blocks:
        raise LoadFailed(f"layer {layer}: chunk at block {span.first_block} does not hold the span")
    if expected is not None and hashes != expected:
        raise LoadFailed(f"layer {layer}: chunk hashes differ from the lookup's")
    want = (len(hashes), 2, g.block_size, g.num_kv_heads, g.head_dim)
    if tuple(chunk.tensor.shape) != want or chunk.tensor.dtype != g.torch_dtype:
        raise LoadFailed(
            f"layer {layer}: chunk is {tuple(chunk.tensor.shape)} {chunk.tensor.dtype}, "
            f"the pool wants {want} {g.torch_dtype}"
        )


async def _read_layer(
    store: TieredStore, req: LoadRequest, layer: int, n: int, pool: MappedPool, bpc: int,
    lease: Lease | None,
) -> list[Part]:
    """Every span's chunk of ``layer``, checked: the lease's DRAM copies first, the rest
    in one batched search of the tiers (one thread hop per tier, not per chunk)."""
    t0 = time.perf_counter()
    keys = [chunk_key(req.tenant, req.model_fp, s.chunk_hash, layer) for s in req.spans]
    found: list[tuple[Chunk | None, str]] = []
    unleased: list[int] = []
    for j, key in enumerate(keys):
        held = lease.blobs.get(key) if lease is not None else None
        if held is None:
            unleased.append(j)
            found.append((None, ""))
            continue
        try:
            found.append((decode_chunk(held, verify=False), store.dram.name))
        except ChunkCorrupt as e:
            raise LoadFailed(f"layer {layer}: chunk {key} is corrupt: {e}") from None
    if unleased:
        try:
            fetched = await store.find_chunks([keys[j] for j in unleased])
        except ChunkCorrupt as e:
            raise LoadFailed(f"layer {layer}: a chunk is corrupt: {e}") from None
        for j, got in zip(unleased, fetched, strict=True):
            found[j] = got
    read_s = (time.perf_counter() - t0) / len(keys)
    parts = []
    pos = layer * n
    for span, key, (chunk, tier) in zip(req.spans, keys, found, strict=True):
        if chunk is None:
            raise LoadFailed(f"layer {layer}: chunk {key} is missing or corrupt")
        _check_chunk(chunk, req, span, layer, pool, bpc,
                     lease.expected.get(key) if lease else None)
        ids = list(req.block_ids[pos : pos + span.use_blocks])
        pos += span.use_blocks
        nbytes = span.use_blocks * pool.geometry.block_bytes
        parts.append(Part(chunk.tensor, span.first_block % bpc, ids, tier, nbytes, read_s))
    return parts


def _copy_parts(kv: torch.Tensor, parts: list[Part]) -> list[float]:
    """Scatter each part into the pool (worker thread); seconds per part."""
    out = []
    for p in parts:
        t0 = time.perf_counter()
        scatter_blocks(kv, p.tensor, p.offset, p.ids)
        out.append(time.perf_counter() - t0)
    return out


async def _finish_copy(kv: torch.Tensor, parts: list[Part]) -> list[float]:
    """Copy on a worker thread; if the caller is cancelled (the engine dropped the stream),
    wait for the thread anyway, so no pool write happens after the call has ended."""
    copy = asyncio.ensure_future(asyncio.to_thread(_copy_parts, kv, parts))
    try:
        return await asyncio.shield(copy)
    except asyncio.CancelledError:
        await asyncio.gather(copy, return_exceptions=True)
        raise


async def load_layers(
    store: TieredStore, pool: MappedPool, req: LoadRequest, bpc: int, lease: Lease | None,
    bandwidth: TierBandwidth, readahead: int,
) -> AsyncIterator[LayerLoaded]:
    """See the module docstring. Raises ``PoolError`` (before any yield) on bad input."""
    n = _check_request(pool, req, bpc)
    kv = pool.kv
    m = store.metrics
    t_start = time.perf_counter()
    ahead: deque[asyncio.Task[list[Part]]] = deque()
    next_layer = 0

    def fill() -> None:
        nonlocal next_layer
        while next_layer < req.num_layers and len(ahead) < readahead:
            ahead.append(asyncio.create_task(
                _read_layer(store, req, next_layer, n, pool, bpc, lease),
                name=f"load-layer-{next_layer}",
            ))
            next_layer += 1

    try:
        for layer in range(req.num_layers):
            fill()
            try:
                parts = await ahead.popleft()
            except LoadFailed as e:
                m.load_failures.inc()
                log.warning("LoadIntoPool stopped: %s", e)
                yield LayerLoaded(layer, False, str(e))
                return
            fill()  # the next layers read while this one copies
            try:
                seconds = await _finish_copy(kv, parts)
            except (RuntimeError, ValueError) as e:
                m.load_failures.inc()
                yield LayerLoaded(layer, False, f"layer {layer}: copy failed: {e}")
                return
            for p, s in zip(parts, seconds):
                bandwidth.observe(p.tier, p.nbytes, p.read_s + s)
                m.pool_bytes_loaded.labels(p.tier).inc(p.nbytes)
            yield LayerLoaded(layer, True)
        m.load_seconds.observe(time.perf_counter() - t_start)
    finally:
        for t in ahead:
            t.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)
