"""LoadIntoPool: leased chunks into pool blocks, lowest layer first, reads ahead of copies.

    reads:   [layer 0] [layer 1] [layer 2] ...      <= readahead layers in flight
                                                    (more when they come from S3)
    copies:            [layer 0] [layer 1] ...      DRAM-held chunks: one worker-thread copy
    replies:                  L0 ok     L1 ok ...    the engine's layer l may start now

A chunk read from a tier below DRAM is verified, checked and put in place where it is
read (``copy_on_read.CopyOnRead``; an SSD chunk goes from its file straight into its
blocks), so its layer needs no copy step; chunks the lease holds in DRAM are checked on the
loop and copied by one worker-thread call per layer.

Target blocks are layer-major: span k's blocks of layer l go to
``block_ids[l * n + off_k : l * n + off_k + use_k]`` with n = sum(use) and off_k the sum
of the earlier spans' use. A target of ``SKIP`` (-1) names a block the engine already
holds on device (a partially resident prefix): it is not written, and a span with every
block of a layer skipped is not read for that layer. Inside its chunk a span starts at
``first_block % blocks_per_chunk``::

    chunk (bpc = 16):  | 0 1 2 ... 7 | 8 ... 12 | 13 14 15 |
    span first_block=40, use=5:  offset 8 ─┘└─ copies these 5 blocks

A chunk file the lease named is read head and payload at once, and the head compared
byte for byte with the one expected for exactly that chunk (``CopyOnRead._read_known``);
any other chunk has its header parsed and checked (key, header hashes, shape, dtype)
before its payload is read. Either way a read straight into the blocks is verified
against its checksum after (a corrupt chunk is then overwritten by the tier below's copy,
or its layer fails). A layer with a missing or failing chunk is reported failed and later
layers are not loaded; whatever was read into its blocks is in the request's own blocks,
and the engine never indexes a failed layer's blocks (it recomputes them). No copy runs
after the call ends: a cancelled load waits for the copies under way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kvstore.bandwidth import TierBandwidth
from services.kvstore.engine_path.attach import MappedPool
from services.kvstore.engine_path.copies import SKIP, scatter_blocks, to_the_end
from services.kvstore.engine_path.copy_on_read import CopyOnRead, no_payload
from services.kvstore.engine_path.leases import Lease
from services.kvstore.engine_path.load_checks import (
    LoadFailed,
    check_decoded,
    check_request,
    key_prefixes,
)
from services.kvstore.engine_path.peer_load import read_peer_layer
from services.kvstore.engine_path.types import LayerLoaded, LoadRequest
from services.kvstore.errors import PeerFetchFailed
from services.kvstore.store import TieredStore
from shared.chunk_codec import Chunk, ChunkCorrupt, ChunkMeta, decode_chunk
from shared.kv_layout import KVSpan

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PEER = "peer"  # the tier name of chunks pulled from another node's kvstore


@dataclass
class Part:
    tensor: torch.Tensor  # (chunk blocks, 2, bs, kvh, hd)
    offset: int  # first block of the chunk to copy
    ids: list[int]  # target pool blocks
    tier: str
    nbytes: int
    read_s: float
    copy_s: float | None = None  # set when the tier read copied it already (CopyOnRead)


async def _read_layer(
    store: TieredStore, req: LoadRequest, layer: int, n: int, pool: MappedPool, bpc: int,
    lease: Lease | None, key_prefixes: dict[bytes, str],
) -> list[Part]:
    """Every span's chunk of ``layer``: the lease's DRAM copies first (checked here, copied
    later by ``_finish_copy``), the rest in one batched search of the tiers, checked and
    copied on the thread that reads them (``CopyOnRead``). A span whose blocks in this
    layer are all ``SKIP`` is already on the device: nothing of it is read."""
    t0 = time.perf_counter()
    all_keys = [key_prefixes[s.chunk_hash] + str(layer) for s in req.spans]
    targets: dict[bytes, tuple[KVSpan, list[int]]] = {}
    pos = layer * n
    spans: list[KVSpan] = []
    keys: list[str] = []
    for span, key in zip(req.spans, all_keys, strict=True):
        ids = list(req.block_ids[pos : pos + span.use_blocks])
        pos += span.use_blocks
        if any(b != SKIP for b in ids):
            targets[span.chunk_hash] = (span, ids)
            spans.append(span)
            keys.append(key)
    found: list[tuple[Chunk | None, str]] = []
    unleased: list[int] = []
    # (every key: a peer's stream is read through each layer it has chunks in)
    pulled = await _from_peer(lease, req, layer, pool, bpc, targets, all_keys)
    for j, key in enumerate(keys):
        if key in pulled:  # read straight into its blocks off the peer's stream
            found.append((Chunk(ChunkMeta(req.tenant, req.model_fp, layer,
                                          (spans[j].chunk_hash,)), no_payload()), PEER))
            continue
        held = lease.blobs.get(key) if lease is not None else None
        if held is None:
            unleased.append(j)
            found.append((None, ""))
            continue
        try:
            found.append((decode_chunk(held, verify=False), store.dram.name))
        except ChunkCorrupt as e:
            raise LoadFailed(f"layer {layer}: chunk {key} is corrupt: {e}") from None
    copier = CopyOnRead(pool.kv, req, layer, pool, bpc, lease, targets,
                         {s.chunk_hash: k for s, k in zip(spans, keys, strict=True)})
    copier.copied.update({spans[j].chunk_hash: s for j, k in enumerate(keys)
                          if (s := pulled.get(k)) is not None})
    if unleased:
        try:
            fetched = await to_the_end(store.find_chunks([keys[j] for j in unleased], copier))
        except ChunkCorrupt as e:
            raise LoadFailed(f"layer {layer}: a chunk is corrupt: {e}") from None
        for j, got in zip(unleased, fetched, strict=True):
            found[j] = got
    read_s = (time.perf_counter() - t0) / max(1, len(keys))
    parts = []
    for span, key, (chunk, tier) in zip(spans, keys, found, strict=True):
        if chunk is None:
            raise LoadFailed(f"layer {layer}: chunk {key} is missing or corrupt")
        why = copier.refused.get(span.chunk_hash)
        if why is not None:
            raise LoadFailed(why)
        copied = copier.copied.get(span.chunk_hash)
        if copied is None:  # a DRAM hit: checked here, copied by _finish_copy
            check_decoded(chunk, req, span, layer, pool, bpc,
                         lease.expected.get(key) if lease else None)
        ids = targets[span.chunk_hash][1]
        nbytes = sum(b != SKIP for b in ids) * pool.geometry.block_bytes
        parts.append(Part(chunk.tensor, span.first_block % bpc, ids, tier, nbytes, read_s,
                          copied))
    return parts


async def _from_peer(
    lease: Lease | None, req: LoadRequest, layer: int, pool: MappedPool, bpc: int,
    targets: dict[bytes, tuple[KVSpan, list[int]]], keys: list[str],
) -> dict[str, float]:
    """This layer's chunks that come from a peer, read off its stream into their blocks
    (key -> seconds); the stream is read for every layer that has any of them."""
    fetch = lease.fetch if lease is not None else None
    if fetch is None or layer >= len(fetch.keys) or not any(k in fetch.expected for k in keys):
        return {}
    try:
        by_hash = await read_peer_layer(fetch, req, layer, pool, bpc, targets)
    except PeerFetchFailed as e:
        raise LoadFailed(f"layer {layer}: {e}") from None
    return {k: by_hash[s.chunk_hash] for s, k in zip(req.spans, keys, strict=True)
            if s.chunk_hash in by_hash}


def _copy_parts(kv: torch.Tensor, parts: list[Part]) -> list[float]:
    """Scatter each part not copied yet into the pool (worker thread); seconds per part
    spent here (0 for parts copied by their read: ``read_s`` already covers that)."""
    out = []
    for p in parts:
        if p.copy_s is not None:
            out.append(0.0)
            continue
        t0 = time.perf_counter()
        scatter_blocks(kv, p.tensor, p.offset, p.ids)
        out.append(time.perf_counter() - t0)
    return out


async def _finish_copy(kv: torch.Tensor, parts: list[Part]) -> list[float]:
    """Copy what the tier reads did not on a worker thread (none: no thread hop)."""
    if all(p.copy_s is not None for p in parts):
        return [0.0] * len(parts)
    return await to_the_end(asyncio.to_thread(_copy_parts, kv, parts))


async def load_layers(
    store: TieredStore, pool: MappedPool, req: LoadRequest, bpc: int, lease: Lease | None,
    bandwidth: TierBandwidth, readahead: int, remote_readahead: int = 1,
) -> AsyncGenerator[LayerLoaded, None]:
    """See the module docstring. Raises ``PoolError`` (before any yield) on bad input.
    ``remote_readahead``: the layers read ahead when the lease found chunks in a remote
    tier (S3: each layer's reads wait on round trips, which overlap; local reads are CPU
    work on the cores the forward pass uses, which more in flight only slows)."""
    n = check_request(pool, req, bpc)
    prefixes = key_prefixes(req)
    kv = pool.kv
    m = store.metrics
    t_start = time.perf_counter()
    ahead: deque[asyncio.Task[list[Part]]] = deque()
    next_layer = 0
    if lease is not None and any(t.remote for t, _ in lease.pins):
        readahead = max(readahead, remote_readahead)

    def fill() -> None:
        nonlocal next_layer
        while next_layer < req.num_layers and len(ahead) < readahead:
            ahead.append(asyncio.create_task(
                _read_layer(store, req, next_layer, n, pool, bpc, lease, prefixes),
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
            for p, s in zip(parts, seconds, strict=False):
                if p.tier != PEER:  # a peer link is measured by its pull (peers/links.py)
                    bandwidth.observe(p.tier, p.nbytes, p.read_s + s)
                m.pool_bytes_loaded.labels(p.tier).inc(p.nbytes)
            yield LayerLoaded(layer, True)
        m.load_seconds.observe(time.perf_counter() - t_start)
    finally:
        for t in ahead:
            t.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)
