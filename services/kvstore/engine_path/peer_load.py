"""LoadIntoPool's chunks that live on a peer: read off its stream into their pool blocks.

The peer sends a layer's chunks in the order the lookup named them. Each one the load
wants is recognised by its head (``ExpectedHead``: built from the block hashes the lookup
matched, the request's tenant, model and layer, and the pool's shape), its payload read
straight into the span's blocks (scratch for the chunk's blocks outside the span), and
its checksum verified over what landed there. A chunk the load does not want (the plan
was trimmed by a device hit) is read and dropped. Anything else (another head, a bad
checksum, a short stream) fails the layer: what was written went into the request's own
blocks, which the engine never indexes for a failed layer (it recomputes them).

A device pool (no host view) reads each chunk into host memory, decodes and scatters it.
"""

from __future__ import annotations

import time
from typing import NoReturn

from services.kvstore.engine_path.attach import MappedPool
from services.kvstore.engine_path.copies import payload_bufs, scatter_blocks
from services.kvstore.engine_path.load_checks import LoadFailed, check_decoded
from services.kvstore.engine_path.types import LoadRequest
from services.kvstore.errors import PeerFetchFailed
from services.kvstore.peers.fetch import PeerFetch
from shared.chunk_codec import (
    ChunkCorrupt,
    ChunkFormatError,
    ChunkMeta,
    ExpectedHead,
    decode_chunk,
    verify_parts,
)
from shared.kv_layout import KVSpan

_HEAD_LIMIT = 1 << 20  # a chunk's preamble and header: ~50 bytes per block hash plus ~100
_SKIP_BUFFER = 1 << 20


async def read_peer_layer(
    fetch: PeerFetch, req: LoadRequest, layer: int, pool: MappedPool, bpc: int,
    targets: dict[bytes, tuple[KVSpan, list[int]]],
) -> dict[bytes, float]:
    """Read ``layer``'s chunks off ``fetch``'s stream; those ``targets`` (chunk hash ->
    span and target blocks) names go into their blocks. Chunk hash -> seconds it took.
    Raises ``PeerFetchFailed`` (the stream is then given up)."""
    await fetch.begin_layer(layer)
    g = pool.geometry
    dest = pool.host_bytes
    most = bpc * g.block_bytes + _HEAD_LIMIT  # no chunk of this pool is bigger
    out: dict[bytes, float] = {}
    for key in fetch.keys[layer]:
        t0 = time.perf_counter()
        hashes = fetch.expected[key]
        n = await fetch.chunk_length(key)
        if n > most:
            _give_up(fetch, f"layer {layer}: the peer announced a {n}-byte chunk (at most "
                     f"{most} fit this pool's chunks)")
        target = targets.get(hashes[-1])
        if target is None:  # not this load's (a device hit trimmed the plan)
            await _skip(fetch, n)
            continue
        span, ids = target
        try:
            want = ExpectedHead(ChunkMeta(req.tenant, req.model_fp, layer, hashes), g.dtype,
                                (len(hashes), 2, g.block_size, g.num_kv_heads, g.head_dim))
        except ChunkFormatError as e:
            _give_up(fetch, f"layer {layer}: chunk {key[:120]} cannot be this load's: {e}")
        if (n != want.payload_offset + want.nbytes
                or len(hashes) < span.first_block % bpc + len(ids)):
            _give_up(fetch, f"layer {layer}: chunk {key[:120]} is not the one the lookup "
                     f"matched ({n} bytes)")
        if dest is None:
            _place_on_device(await _whole(fetch, n), req, span, ids, layer, pool, bpc,
                             hashes, fetch)
        else:
            lead = bytearray(want.payload_offset)
            bufs = payload_bufs(g.block_bytes, span, bpc, len(hashes), ids, dest)
            await fetch.recv_into([memoryview(lead), *bufs])
            head = want.match(lead, n)
            if head is None:
                _give_up(fetch, f"layer {layer}: chunk {key[:120]} has another head than "
                         "the one the lookup matched")
            try:
                verify_parts(head, bufs)
            except ChunkCorrupt as e:
                fetch.metrics.checksum_failures.labels("peer").inc()
                _give_up(fetch, f"layer {layer}: chunk {key[:120]} is corrupt: {e}")
        out[hashes[-1]] = time.perf_counter() - t0
    fetch.end_layer(layer)
    return out


def _give_up(fetch: PeerFetch, why: str) -> NoReturn:
    """The stream's position is lost with this chunk: fail it, and this layer."""
    fetch.fail(why)
    raise PeerFetchFailed(f"from peer {fetch.peer}: {why}")


async def _skip(fetch: PeerFetch, n: int) -> None:
    """Read ``n`` bytes off the stream and drop them (through a bounded scratch buffer)."""
    scratch = memoryview(bytearray(min(n, _SKIP_BUFFER)))
    while n > 0:
        step = min(n, len(scratch))
        await fetch.recv_into([scratch[:step]])
        n -= step


async def _whole(fetch: PeerFetch, n: int) -> bytearray:
    blob = bytearray(n)
    await fetch.recv_into([memoryview(blob)])
    return blob


def _place_on_device(blob: bytearray, req: LoadRequest, span: KVSpan, ids: list[int],
                     layer: int, pool: MappedPool, bpc: int, hashes: tuple[bytes, ...],
                     fetch: PeerFetch) -> None:
    try:
        chunk = decode_chunk(blob)  # verifies the checksum
        check_decoded(chunk, req, span, layer, pool, bpc, hashes)
        scatter_blocks(pool.kv, chunk.tensor, span.first_block % bpc, ids)
    except (ChunkCorrupt, LoadFailed, RuntimeError, ValueError) as e:
        _give_up(fetch, f"layer {layer}: {e}")
