"""Tensor copies between the engine's pool and chunk blobs (run on worker threads).

    pool kv:  (num_blocks, 2, block_size, kv_heads, head_dim)
    a chunk:  (n_blocks,   2, block_size, kv_heads, head_dim)   = kv[ids of one layer]

Saving gathers a layer's blocks of one chunk into a blob; loading scatters a slice of a
chunk into the target blocks. Only the listed blocks are ever written.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from shared.chunk_codec import ChunkMeta, encode_chunk
from shared.kv_layout import KVSpan

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

SKIP = -1  # a target block id meaning "already on device: do not write"


@functools.cache
def lazy_torch() -> Any:
    # Imported on the first pool operation: a kvstore without an attached pool never needs
    # torch, and importing it costs seconds of process start-up.
    import torch

    # Pool copies are memory-bound and run beside the engine's forward pass on the same
    # cores: one thread. Two made a 48 MiB scatter slower here (12 vs 9 ms) for twice the
    # CPU time, taken from the compute the load is meant to overlap.
    torch.set_num_threads(1)
    return torch


def _is_run(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(ids))


def gather_blocks(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``kv[ids]`` as a CPU tensor; a consecutive run is a view (one copy fewer)."""
    if _is_run(ids):
        out = kv[ids[0] : ids[-1] + 1]  # (n, 2, bs, kvh, hd) view
    else:
        torch = lazy_torch()
        out = kv.index_select(0, torch.tensor(ids, dtype=torch.long, device=kv.device))
    return out if out.device.type == "cpu" else out.cpu()


def encode_from_pool(kv: torch.Tensor, jobs: list[tuple[ChunkMeta, list[int]]]) -> list[bytearray]:
    """One unsealed blob per (chunk meta, pool block ids of that chunk and layer)."""
    return [encode_chunk(meta, gather_blocks(kv, ids), seal=False) for meta, ids in jobs]


def scatter_blocks(kv: torch.Tensor, chunk: torch.Tensor, offset: int, ids: list[int]) -> None:
    """``kv[ids] = chunk[offset : offset + len(ids)]`` (the caller checked the shapes);
    ``SKIP`` targets are left alone."""
    src = chunk[offset : offset + len(ids)]  # (len(ids), 2, bs, kvh, hd)
    if SKIP in ids:
        keep = [i for i, b in enumerate(ids) if b != SKIP]
        if not keep:
            return
        src = src[keep]
        ids = [ids[i] for i in keep]
    if src.device != kv.device:
        src = src.to(kv.device, non_blocking=False)
    if _is_run(ids):
        kv[ids[0] : ids[-1] + 1].copy_(src)
    else:
        torch = lazy_torch()
        kv.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=kv.device), src)



async def to_the_end(aw: Awaitable[T]) -> T:
    """Await ``aw``; if the caller is cancelled (the engine dropped the call), let it finish
    anyway first, so no pool read or write from a worker thread runs after the call ended."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


def block_runs(ids: list[int]) -> list[tuple[int, int]]:
    """``ids`` as (first, count) runs of consecutive block ids; ``SKIP`` entries form
    runs of their own, ``(SKIP, count)``."""
    if ids and ids[0] != SKIP and ids == list(range(ids[0], ids[0] + len(ids))):
        return [(ids[0], len(ids))]  # the common case, in C
    out: list[tuple[int, int]] = []
    for b in ids:
        last = out[-1][0] if out else None
        if last is not None and (last == SKIP if b == SKIP
                                 else last != SKIP and last + out[-1][1] == b):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def payload_bufs(bb: int, span: KVSpan, bpc: int, chunk_blocks: int, ids: list[int],
                 dest: memoryview) -> list[memoryview]:
    """Where a chunk's payload is read to: the span's blocks (``bb`` bytes each, in the
    host pool ``dest``), and scratch for the chunk's blocks outside the span (read too:
    the checksum covers them)."""
    off = span.first_block % bpc
    bufs = [memoryview(bytearray(off * bb))] if off else []
    for first, n in block_runs(ids):
        bufs.append(memoryview(bytearray(n * bb)) if first == SKIP
                    else dest[first * bb : (first + n) * bb])
    if chunk_blocks > off + len(ids):
        bufs.append(memoryview(bytearray((chunk_blocks - off - len(ids)) * bb)))
    return bufs
