"""Plain data the engine core hands to the event loop for the kvstore (and back).

The core is single-threaded and never waits on the network: at admission it describes a
load (``LoadJob``), at the end of a request a save (``SaveJob``); the event loop runs the
RPCs; a save's pinned blocks come back to the core through its worker's inbox.

Block ids are layer-major, as the kvstore's rpcs take them:

    block_ids = [ layer 0: b(first) .. b(end-1) | layer 1: ... | ... | layer L-1: ... ]
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.layer_readiness import LayerReadiness
from services.engine.reuse_plan import ReusePlan
from shared.session_key import SessionKey


@dataclass(frozen=True)
class PoolGeometry:
    """What the kvstore needs to map the engine's pool (AttachPool)."""

    pool_name: str  # CPU: the shared-memory file; CUDA: the IPC handle
    device: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_layers: int
    model_fp: str


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    tenant: str
    plan: ReusePlan
    block_ids: tuple[int, ...]  # layer-major over blocks [plan.first_block, plan.end_block)
    readiness: LayerReadiness


@dataclass(frozen=True)
class SaveJob:
    job_id: int
    session: SessionKey
    block_hashes: tuple[bytes, ...]  # every full block of the sequence, from block 0
    token_count: int
    first_block: int  # a chunk boundary; block_ids start at this block
    block_ids: tuple[int, ...]  # layer-major over blocks [first_block, len(block_hashes))
    retain_s: float = 0.0  # the session's prompt_cache_retention in seconds (0: tier TTLs)
