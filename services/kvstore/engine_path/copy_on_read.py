"""The check a LoadIntoPool layer's tier reads run where each chunk is read: verify it,
check it against the request, and put its blocks in place (``CopyOnRead``).

A chunk in a file (the SSD tier) of a host-memory pool is read straight into its blocks
with ``preadv``: when the lease named the chunk, its head and payload in one read, the head
then compared byte for byte with the one ``encode_chunk`` writes for exactly that chunk
(``ExpectedHead``); any other chunk has its head read, parsed and checked first. Either
way the checksum is verified over what was read into the blocks::

    chunk file:  [ preamble + header | payload (blocks, 2, bs, kvh, hd) ]
                   └ lead buffer ───┘  └ preadv straight into the span's target blocks

A chunk already in memory (RocksDB's small values, S3), and any chunk bound for a device
pool, is verified, decoded and scattered into its blocks while its bytes are still in the
CPU's cache.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from services.kvstore.engine_path.attach import MappedPool
from services.kvstore.engine_path.copies import lazy_torch, payload_bufs, scatter_blocks
from services.kvstore.engine_path.leases import Lease
from services.kvstore.engine_path.load_checks import LoadFailed, check_chunk
from services.kvstore.engine_path.types import LoadRequest
from services.kvstore.store import chunk_tier_key
from services.kvstore.store.keys import chunk_of
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

HEAD_READ = 4096  # a chunk's preamble and header: ~50 bytes per block hash plus ~100


@functools.cache
def no_payload() -> torch.Tensor:
    """The tensor of a chunk read straight into pool blocks (never written: shared)."""
    return lazy_torch().empty(0)


class CopyOnRead:
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
        # ChunkCorrupt (forged, swapped) propagates to the store: counted and deleted
        chunk = decode_chunk(hit.blob(), key=chunk_of(hit.key))
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
        prefix = hit.read(0, HEAD_READ)
        need = head_length(prefix)  # ChunkCorrupt propagates
        if len(prefix) < min(need, hit.nbytes):
            prefix = hit.read(0, need)
        head = parse_head(prefix, hit.nbytes)
        if head.meta.key != chunk_of(hit.key):  # moved here from another key: corrupt
            raise ChunkCorrupt(f"the chunk under {hit.key[:120]} is {head.meta.key[:120]}")
        target = self._target(head.meta, head.shape, head.dtype)
        if target is None:
            return Chunk(head.meta, no_payload())
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
        empty = Chunk(head.meta, no_payload())  # the blocks hold the data
        try:
            verify_parts(head, bufs)
        except ChunkCorrupt:
            # What failed is the copy in the pool's blocks, which something else may have
            # written while they were read. Only the file's own bytes may condemn it (the
            # store deletes a copy that raises here): check them apart.
            verify_chunk(hit.blob(), chunk_of(hit.key))
            self.refused[span.chunk_hash] = (
                f"layer {self.layer}: the target blocks changed while the chunk was read")
            return empty
        self.copied[span.chunk_hash] = time.perf_counter() - t0
        return empty
