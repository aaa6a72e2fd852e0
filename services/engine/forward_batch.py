"""The boundary between the engine's scheduler/runner and the model: one step's batch.

KV layout (DESIGN §2): the pool is ONE tensor shared by every layer,

    kv_cache: (num_blocks, 2, block_size, num_kv_heads, head_dim)   # [:,0]=K, [:,1]=V

and a pool block holds K and V of ONE layer for ``block_size`` tokens. Each sequence owns
one block table per layer, so layer ``l`` of sequence ``s`` reads blocks
``block_tables[l][s, :ceil(kv_lens[s] / block_size)]``.

A step packs the new tokens of all scheduled sequences back to back:

    input_ids:  | seq0: q_lens[0] tokens | seq1: q_lens[1] tokens | ... |   (T,)
    positions:  absolute position of each of those tokens                 (T,)

Sequence ``s`` has ``kv_lens[s] - q_lens[s]`` tokens already in the cache (reused or
computed earlier) and attends causally over all ``kv_lens[s]`` tokens.
``slot_mapping[l][t] = block * block_size + offset`` is where the model writes the K/V of
new token ``t`` for layer ``l`` before attending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    q_lens: list[int]  # new tokens per sequence; sum == T
    kv_lens: list[int]  # context length per sequence after this step (cached + new)
    block_tables: list[torch.Tensor]  # per layer: (num_seqs, max_blocks) int64, pad = 0
    slot_mapping: list[torch.Tensor]  # per layer: (T,) int64 flat slot index into the pool
    logits_indices: torch.Tensor  # (num_seqs,) int64 row in T whose logits are wanted
    # (layers, T) int64: where new token t's K goes in the pool viewed as rows of
    # (kvh, hd): block * 2 * block_size + offset (its V block_size rows further on). None:
    # derived from slot_mapping (the runner fills it in; test batches may leave it out).
    kv_rows: torch.Tensor | None = None
    # (layers, num_seqs, max_blocks): ``block_tables`` as the one tensor they are views of
    # (the runner has it; None: stacked when needed).
    block_table_stack: torch.Tensor | None = None
    # Called with a layer index before that layer reads the cache; blocks until reused KV
    # for that layer is resident (layer-wise loading, Symphony §3.4). None = all resident.
    wait_for_layer: Callable[[int], None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
