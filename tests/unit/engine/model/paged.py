"""Test helper: a contiguous-block KV pool and ForwardBatch builder (the real allocator
belongs to the engine runtime)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.forward_batch import ForwardBatch
from services.engine.model import LlamaModel


@dataclass
class PagedCache:
    """Each (layer, sequence) gets a fixed run of blocks; layers use different blocks so a
    mix-up between layers would show in the results."""

    model: LlamaModel
    num_seqs: int
    max_len: int
    block_size: int = 4
    kv_cache: torch.Tensor = field(init=False)
    tables: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.model.config
        per_seq = -(-self.max_len // self.block_size)
        n_layers = cfg.num_layers
        total = n_layers * self.num_seqs * per_seq + 1  # block 0 stays unused (table padding)
        self.kv_cache = torch.zeros(total, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=self.model.dtype)
        # Interleave layers and sequences, and reverse order, so blocks are not trivially
        # contiguous per sequence.
        ids = torch.arange(1, total).flip(0).view(per_seq, n_layers, self.num_seqs)
        self.tables = [ids[:, layer, :].t().contiguous() for layer in range(n_layers)]

    def batch(self, new_tokens: list[list[int]], cached: list[int]) -> ForwardBatch:
        """One step: sequence ``s`` (index in this cache) adds ``new_tokens[s]`` after
        ``cached[s]`` tokens. Empty lists skip a sequence."""
        seqs = [s for s, toks in enumerate(new_tokens) if toks]
        ids, pos, slots_by_layer, q_lens, kv_lens, last = [], [], [], [], [], []
        for s in seqs:
            n = len(new_tokens[s])
            ids.extend(new_tokens[s])
            pos.extend(range(cached[s], cached[s] + n))
            q_lens.append(n)
            kv_lens.append(cached[s] + n)
            last.append(len(ids) - 1)
        positions = torch.tensor(pos)
        for table in self.tables:
            rows = []
            for s in seqs:
                p = torch.arange(cached[s], cached[s] + len(new_tokens[s]))
                rows.append(table[s][p // self.block_size] * self.block_size
                            + p % self.block_size)
            slots_by_layer.append(torch.cat(rows))
        return ForwardBatch(
            input_ids=torch.tensor(ids), positions=positions, q_lens=q_lens, kv_lens=kv_lens,
            block_tables=[t[seqs] for t in self.tables], slot_mapping=slots_by_layer,
            logits_indices=torch.tensor(last))

    def step(self, new_tokens: list[list[int]], cached: list[int]) -> torch.Tensor:
        return self.model(self.batch(new_tokens, cached), self.kv_cache)


def greedy(model: LlamaModel, prompt: list[int], steps: int, block_size: int = 4) -> list[int]:
    cache = PagedCache(model, 1, len(prompt) + steps, block_size)
    logits = cache.step([prompt], [0])
    out = [int(logits[0].argmax())]
    for _ in range(steps - 1):
        logits = cache.step([[out[-1]]], [len(prompt) + len(out) - 1])
        out.append(int(logits[0].argmax()))
    return out
