"""Plain data of the engine-pool path (wire.py converts protos to and from these)."""

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
    peer_address: str = ""  # the kvstore that served the session's last turn ("" = none)
    peer_wait_tokens: int = 0  # that turn's length: the peer waits for its save
    whole_session: bool = False  # the prompt is the session's stored sequence (device prefetch)


@dataclass(frozen=True)
class FindRequest:
    """FindPrefix: a peer asks what this node holds of a prompt (``LookupRequest`` plus
    the asker's chunk grid and how long a save it expects)."""

    tenant: str
    session_id: str
    model_fp: str
    block_hashes: tuple[bytes, ...]
    first_block: int
    num_layers: int
    blocks_per_chunk: int
    wait_tokens: int = 0


@dataclass(frozen=True)
class PeerChunk:
    """A chunk a peer holds: all of its block hashes, and the blocks of it to use."""

    chunk_hashes: tuple[bytes, ...]
    first_block: int
    use_blocks: int
    tier: str


@dataclass(frozen=True)
class FoundOnPeer:
    matched_blocks: int
    chunks: tuple[PeerChunk, ...]
    lease_id: str
    waited_s: float = 0.0
    data_port: int = 0  # the answering node's ChunkServer port (0: pull over gRPC)


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
    retain_s: float = 0.0  # keep the session this long after the save (0 = tier TTLs)


@dataclass(frozen=True)
class SaveResult:
    chunks_written: int
    chunks_skipped: int
