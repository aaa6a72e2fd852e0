"""Plain data of the pool data path (wire.py converts protos to and from these)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv_layout import KVSpan


@dataclass(frozen=True)
class LookupRequest:
    tenant: str
    session_id: str  # "" = probe full-chunk keys (and the prompt's own end) only
    model_fp: str
    block_hashes: tuple[bytes, ...]
    first_block: int
    num_layers: int


@dataclass(frozen=True)
class LoadRequest:
    pool_id: str
    lease_id: str
    tenant: str
    model_fp: str
    spans: tuple[KVSpan, ...]
    block_ids: tuple[int, ...]  # layer-major: block_ids[layer * n + i]
    num_layers: int
    op_id: str = ""  # the engine's id of this call, for FencePoolOp ("" = none)


@dataclass(frozen=True)
class LayerLoaded:
    layer: int
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class SaveRequest:
    pool_id: str
    tenant: str
    session_id: str  # "" = cache chunks without a manifest
    model_fp: str
    block_hashes: tuple[bytes, ...]  # every full block of the sequence, from block 0
    token_count: int
    first_block: int  # a multiple of blocks_per_chunk
    block_ids: tuple[int, ...]  # layer-major: block_ids[layer * n + i] = block first_block+i
    num_layers: int
    op_id: str = ""  # the engine's id of this call, for FencePoolOp ("" = none)


@dataclass(frozen=True)
class SaveResult:
    chunks_written: int
    chunks_skipped: int
