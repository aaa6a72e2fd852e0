"""Turns a scheduler step into one ForwardBatch, runs the model, samples.

Packing (see forward_batch.py): the scheduled sequences' new tokens back to back,

    seq s computes positions [start_s, start_s + n_s)   start_s = num_computed_tokens
    slot of (layer l, position p) = table_l[s][p // bs] * bs + p % bs

built for all layers at once from one (layers, seqs, max_blocks) table tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .forward_batch import ForwardBatch
from .sampling import Sampler
from .scheduler import SchedulerOutput
from .sequence import Sequence


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_cache: torch.Tensor, num_layers: int, block_size: int
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.num_layers = num_layers
        self.block_size = block_size
        self.device = kv_cache.device
        self.sampler = Sampler()

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        seqs = out.sequences
        q_lens = [out.num_scheduled_tokens[s.request_id] for s in seqs]
        starts = [s.num_computed_tokens for s in seqs]
        ids: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        for i, (s, start, n) in enumerate(zip(seqs, starts, q_lens, strict=True)):
            ids.extend(s.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_index.extend([i] * n)
        max_blocks = max(s.num_blocks for s in seqs)
        rows = [
            [t + [0] * (max_blocks - len(t)) for t in layer_tables]
            for layer_tables in zip(*(s.block_tables for s in seqs), strict=True)
        ]
        tables = torch.tensor(rows, dtype=torch.int64)  # (layers, seqs, max_blocks)
        pos = torch.tensor(positions, dtype=torch.int64)  # (T,)
        idx = torch.tensor(seq_index, dtype=torch.int64)  # (T,)
        bs = self.block_size
        slots = tables[:, idx, pos // bs] * bs + pos % bs  # (layers, T)
        ends = torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1  # (seqs,)
        dev = self.device
        tables, slots = tables.to(dev), slots.to(dev)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=pos.to(dev),
            q_lens=q_lens,
            kv_lens=[st + n for st, n in zip(starts, q_lens, strict=True)],
            block_tables=list(tables.unbind(0)),
            slot_mapping=list(slots.unbind(0)),
            logits_indices=ends.to(dev),
        )

    def execute(
        self, out: SchedulerOutput, wait_for_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Logits (num_seqs, vocab) float32 of the last scheduled token of each sequence.
        ``wait_for_layer(l)`` runs before layer ``l`` reads the cache (layer-wise loads)."""
        batch = self.build_batch(out)
        batch.wait_for_layer = wait_for_layer
        with torch.inference_mode():
            return self.model(batch, self.kv_cache)

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seqs: list[Sequence],
        generators: list[torch.Generator],
        masks: list[torch.Tensor | None] | None = None,
    ) -> list[int]:
        """Sample one token for each of ``seqs`` from ``logits[rows]``; ``masks[i]``, when
        given, is the bool mask of the tokens sequence ``i`` may take (a grammar's)."""
        sub = logits[torch.tensor(rows)] if len(rows) != logits.shape[0] else logits
        return self.sampler.sample(sub.cpu(), [s.sampling for s in seqs], generators, masks)
