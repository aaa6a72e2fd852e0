"""LoadIntoPool: leased chunks into pool blocks, lowest layer first, reads ahead of copies.

    reads:   [layer 0] [layer 1] [layer 2] ...      <= readahead layers in flight
    copies:            [layer 0] [layer 1] ...      DRAM-held chunks: one worker-thread copy
    replies:                  L0 ok     L1 ok ...    the engine's layer l may start now

A chunk read from a tier below DRAM is verified, checked and put in place where it is
read (``_CopyOnRead``; an SSD chunk goes from its file straight into its blocks), so its
layer needs no copy step; chunks the lease holds in DRAM are checked on the loop and
copied by one worker-thread call per layer.

Target blocks are layer-major: span k's blocks of layer l go to
``block_ids[l * n + off_k : l * n + off_k + use_k]`` with n = sum(use) and off_k the sum
of the earlier spans' use. A target of ``SKIP`` (-1) names a block the engine already
holds on device (a partially resident prefix): it is not written, and a span with every
block of a layer skipped is not read for that layer. Inside its chunk a span starts at
``first_block % blocks_per_chunk``::

    chunk (bpc = 16):  | 0 1 2 ... 7 | 8 ... 12 | 13 14 15 |
    span first_block=40, use=5:  offset 8 ─┘└─ copies these 5 blocks

A chunk file the lease named is read head and payload at once, and the head compared
byte for byte with the one expected for exactly that chunk (``_CopyOnRead._read_known``);
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
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kvstore.bandwidth import TierBandwidth
from services.kvstore.engine_path.attach import MappedPool
from services.kvstore.engine_path.copies import (
    SKIP,
    lazy_torch,
    payload_bufs,
    scatter_blocks,
    to_the_end,
)
from services.kvstore.engine_path.leases import Lease
from services.kvstore.engine_path.load_checks import (
    LoadFailed,
    check_chunk,
    check_decoded,
    check_request,
    key_prefixes,
)
from services.kvstore.engine_path.peer_load import read_peer_layer
from services.kvstore.engine_path.types import LayerLoaded, LoadRequest
from services.kvstore.errors import PeerFetchFailed
from services.kvstore.store import TieredStore, chunk_tier_key
from services.kvstore.tiers.base import Stored
from shared.chunk_codec import (
    Chunk,
    ChunkCorrupt,
    ChunkFormatError,
    ChunkHead,
    ChunkMeta,
    ExpectedHead,
    decode_chunk,
    head_length,
    parse_head,
    verify_chunk,
    verify_parts,
)
from shared.kv_layout import KVSpan

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PEER = "peer"  # the tier name of chunks pulled from another node's kvstore
_HEAD_READ = 4096  # a chunk's preamble and header: ~50 bytes per block hash plus ~100


@dataclass
class Part:
    tensor: torch.Tensor  # (chunk blocks, 2, bs, kvh, hd)
    offset: int  # first block of the chunk to copy
    ids: list[int]  # target pool blocks
    tier: str
    nbytes: int
    read_s: float
    copy_s: float | None = None  # set when the tier read copied it already (_CopyOnRead)


@functools.cache
def _no_payload() -> torch.Tensor:
    """The tensor of a chunk read straight into pool blocks (never written: shared)."""
    return lazy_torch().empty(0)


class _CopyOnRead:
    """The ``check`` a layer's tier reads run where they are read (inline for a page-cache
    hit, else on the reading thread): verify the chunk, check it against the request, and
    put its blocks in place.

    A chunk in a file of a host-memory pool's kvstore is read straight into its target
    blocks (``preadv``: header first, checked, then the payload, then the checksum over
    what was read), one copy in all. A chunk already in memory (RocksDB's small values,
    S3, a device pool) is verified and decoded first, then scattered while its bytes are
    still in the CPU's cache. Either way this spares the event loop the work and the layer
    a second thread hop: the load's CPU time is what its overlap with the forward pass is
    up against on a CPU pool.

    A chunk that fails its checksum raises ``ChunkCorrupt`` (the store deletes that copy
    and reads the tier below, whose copy then overwrites the blocks). Any other problem is
    found before anything is copied and recorded in ``refused``: the layer fails, the
    engine recomputes it, and the blocks written by the layer's other chunks are never
    indexed.
    """

    def __init__(self, kv: torch.Tensor, req: LoadRequest, layer: int, pool: MappedPool,
                 bpc: int, lease: Lease | None, targets: dict[bytes, tuple[KVSpan, list[int]]],
                 keys: dict[bytes, str]) -> None:
        self.kv, self.req, self.layer, self.pool, self.bpc = kv, req, layer, pool, bpc
        self.lease = lease
        self.targets = targets  # chunk hash -> (span, target block ids)
        self.keys = keys  # chunk hash -> key of its chunk in this layer
        self.by_tier_key = {chunk_tier_key(k): h for h, k in keys.items()}
        self.copied: dict[bytes, float] = {}  # chunk hash -> seconds copying
        self.refused: dict[bytes, str] = {}

    def __call__(self, hit: Stored) -> Chunk:
        dest = self.pool.host_bytes
        if hit.kept is None and dest is not None:
            return self._read_into_blocks(hit, dest)
        chunk = decode_chunk(hit.blob())  # ChunkCorrupt propagates to the store
        target = self._target(chunk.meta, tuple(chunk.tensor.shape),
                              str(chunk.tensor.dtype).removeprefix("torch."))
        if target is not None:
            span, ids = target
            try:
                t0 = time.perf_counter()
                scatter_blocks(self.kv, chunk.tensor, span.first_block % self.bpc, ids)
                self.copied[span.chunk_hash] = time.perf_counter() - t0
            except Exception as e:  # never out of the tier's read: it fails the whole batch
                self.refused[span.chunk_hash] = f"layer {self.layer}: copy failed: {e}"
        return chunk

    def _target(self, meta: ChunkMeta, shape: tuple[int, ...], dtype: str
                ) -> tuple[KVSpan, list[int]] | None:
        """The span and blocks this chunk goes to, or None (refused, reason recorded)."""
        last = meta.block_hashes[-1]
        try:
            target = self.targets.get(last)
            if target is None:
                raise LoadFailed(f"layer {self.layer}: a read chunk is not one of the request's")
            span = target[0]
            check_chunk(meta, shape, dtype, self.req, span, self.layer, self.pool, self.bpc,
                         self.lease.expected.get(self.keys[last]) if self.lease else None)
            return target
        except LoadFailed as e:
            self.refused[last] = str(e)
            return None

    def _read_into_blocks(self, hit: Stored, dest: memoryview) -> Chunk:
        known = self._read_known(hit, dest)
        if known is not None:
            return known
        prefix = hit.read(0, _HEAD_READ)
        need = head_length(prefix)  # ChunkCorrupt propagates
        if len(prefix) < min(need, hit.nbytes):
            prefix = hit.read(0, need)
        head = parse_head(prefix, hit.nbytes)
        target = self._target(head.meta, head.shape, head.dtype)
        if target is None:
            return Chunk(head.meta, _no_payload())
        span, ids = target
        t0 = time.perf_counter()
        bufs = self._payload_bufs(span, len(head.meta.block_hashes), ids, dest)
        hit.readinto(head.payload_offset, bufs)
        return self._verified(hit, head, span, bufs, t0)

    def _read_known(self, hit: Stored, dest: memoryview) -> Chunk | None:
        """The chunk the lease names for this key, read head and payload in one ``preadv``
        and recognised by its head's bytes (``ExpectedHead``: nothing to parse or check);
        None if it is not that (the general read then parses the head, refuses it with a
        reason or reads it again). What that read put in the blocks is harmless: they are
        the request's own, and no layer is reported loaded from them."""
        h = self.by_tier_key.get(hit.key)
        if h is None or self.lease is None:
            return None
        hashes = self.lease.expected.get(self.keys[h])
        span, ids = self.targets[h]
        if (hashes is None or hashes[-1] != h or len(hashes) > self.bpc
                or len(hashes) < span.first_block % self.bpc + len(ids)):
            return None
        t0 = time.perf_counter()
        g = self.pool.geometry
        try:
            want = ExpectedHead(
                ChunkMeta(self.req.tenant, self.req.model_fp, self.layer, hashes), g.dtype,
                (len(hashes), 2, g.block_size, g.num_kv_heads, g.head_dim))
        except ChunkFormatError:  # hashes no chunk can have (the lookup's prompt is the
            return None  # client's): the general path refuses the chunk with its reason
        if hit.nbytes != want.payload_offset + want.nbytes:
            return None
        lead = bytearray(want.payload_offset)
        bufs = self._payload_bufs(span, len(hashes), ids, dest)
        hit.readinto(0, [memoryview(lead), *bufs])
        head = want.match(lead, hit.nbytes)
        return None if head is None else self._verified(hit, head, span, bufs, t0)

    def _payload_bufs(self, span: KVSpan, chunk_blocks: int, ids: list[int],
                      dest: memoryview) -> list[memoryview]:
        return payload_bufs(self.pool.geometry.block_bytes, span, self.bpc, chunk_blocks,
                            ids, dest)

    def _verified(self, hit: Stored, head: ChunkHead, span: KVSpan,
                  bufs: list[memoryview], t0: float) -> Chunk:
        empty = Chunk(head.meta, _no_payload())  # the blocks hold the data
        try:
            verify_parts(head, bufs)
        except ChunkCorrupt:
            # What failed is the copy in the pool's blocks, which something else may have
            # written while they were read. Only the file's own bytes may condemn it (the
            # store deletes a copy that raises here): check them apart.
            verify_chunk(hit.blob())
            self.refused[span.chunk_hash] = (
                f"layer {self.layer}: the target blocks changed while the chunk was read")
            return empty
        self.copied[span.chunk_hash] = time.perf_counter() - t0
        return empty


async def _read_layer(
    store: TieredStore, req: LoadRequest, layer: int, n: int, pool: MappedPool, bpc: int,
    lease: Lease | None, key_prefixes: dict[bytes, str],
) -> list[Part]:
    """Every span's chunk of ``layer``: the lease's DRAM copies first (checked here, copied
    later by ``_finish_copy``), the rest in one batched search of the tiers, checked and
    copied on the thread that reads them (``_CopyOnRead``). A span whose blocks in this
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
                                          (spans[j].chunk_hash,)), _no_payload()), PEER))
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
    copier = _CopyOnRead(pool.kv, req, layer, pool, bpc, lease, targets,
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
    bandwidth: TierBandwidth, readahead: int,
) -> AsyncGenerator[LayerLoaded, None]:
    """See the module docstring. Raises ``PoolError`` (before any yield) on bad input."""
    n = check_request(pool, req, bpc)
    prefixes = key_prefixes(req)
    kv = pool.kv
    m = store.metrics
    t_start = time.perf_counter()
    ahead: deque[asyncio.Task[list[Part]]] = deque()
    next_layer = 0

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
