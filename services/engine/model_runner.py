"""Turns a scheduler step into one ForwardBatch, runs the model, samples.

Packing (see forward_batch.py): the scheduled sequences' new tokens back to back,

    seq s computes positions [start_s, start_s + n_s)   start_s = num_computed_tokens
    slot of (layer l, position p) = table_l[s][p // bs] * bs + p % bs

built for all layers at once from one (layers, seqs, max_blocks) table tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .forward_batch import ForwardBatch
from .logits_processors import History
from .sampling import Sampled, Sampler
from .scheduler import SchedulerOutput
from .sequence import Sequence

# Steps with at most this many (layer, token) slots compute them as Python ints (decodes),
# larger ones with tensor ops: each torch op costs ~5-10 us on CPU, a Python slot ~0.1 us.
PYTHON_SLOTS = 512


@dataclass
class LogitRows:
    """Which rows of a step's logits are what. Each sequence's last scheduled token gives
    the row it samples from (``last[i]``); a sequence computing prompt positions whose
    log-probabilities it wants (``echo``) has a row for each of them:

        prompt[request_id] = (first position, first row, count)
        row first_row + j: the logits at position first + j, which predict token first+j+1
    """

    indices: list[int] = field(default_factory=list)  # rows of the packed tokens wanted
    last: list[int] = field(default_factory=list)
    prompt: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def logit_rows(out: SchedulerOutput) -> LogitRows:
    rows = LogitRows()
    t = 0
    for s in out.sequences:
        n = out.num_scheduled_tokens[s.request_id]
        start = s.num_computed_tokens
        wanted = min(start + n, s.num_prompt_tokens - 1) - start  # positions before the last
        if s.sampling.prompt_logprobs >= 0 and wanted > 0:
            rows.prompt[s.request_id] = (start, len(rows.indices), wanted)
            rows.indices.extend(range(t, t + wanted))
            if wanted == n:  # the chunk's last token is a prompt position's too
                rows.last.append(len(rows.indices) - 1)
                t += n
                continue
        rows.last.append(len(rows.indices))
        rows.indices.append(t + n - 1)
        t += n
    return rows


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
        for s, start, n in zip(seqs, starts, q_lens, strict=True):
            ids.extend(s.token_ids[start : start + n])
            positions.extend(range(start, start + n))
        num_layers, bs, dev = self.num_layers, self.block_size, self.device
        max_blocks = max(s.num_blocks for s in seqs)
        flat: list[int] = []  # (layers, seqs, max_blocks), padded with block 0
        for layer in range(num_layers):
            for s in seqs:
                table = s.block_tables[layer]
                flat.extend(table)
                flat.extend([0] * (max_blocks - len(table)))
        tables = torch.tensor(flat, dtype=torch.int64).view(num_layers, len(seqs), max_blocks)
        pos = torch.tensor(positions, dtype=torch.int64)  # (T,)
        if len(positions) * num_layers <= PYTHON_SLOTS:
            # Decode steps: a few slots, cheaper as Python ints than as five tensor ops.
            slot_list: list[int] = []
            row_list: list[int] = []
            for layer in range(num_layers):
                for s, start, n in zip(seqs, starts, q_lens, strict=True):
                    table = s.block_tables[layer]
                    for p in range(start, start + n):
                        block, offset = divmod(p, bs)
                        slot_list.append(table[block] * bs + offset)
                        row_list.append(table[block] * 2 * bs + offset)
            shape = (num_layers, len(positions))
            slots = torch.tensor(slot_list, dtype=torch.int64).view(shape)
            kv_rows = torch.tensor(row_list, dtype=torch.int64).view(shape)
        else:
            idx = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(q_lens))
            blocks = tables[:, idx, pos // bs]  # (layers, T)
            offsets = pos % bs
            slots = blocks * bs + offsets
            kv_rows = blocks * (2 * bs) + offsets
        rows = logit_rows(out)
        if dev.type != "cpu":
            tables, slots, pos = tables.to(dev), slots.to(dev), pos.to(dev)
            kv_rows = kv_rows.to(dev)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=pos,
            q_lens=q_lens,
            kv_lens=[st + n for st, n in zip(starts, q_lens, strict=True)],
            block_tables=list(tables.unbind(0)),
            slot_mapping=list(slots.unbind(0)),
            logits_indices=torch.tensor(rows.indices, dtype=torch.int64, device=dev),
            kv_rows=kv_rows,
            block_table_stack=tables,
        )

    def execute(
        self, out: SchedulerOutput, wait_for_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Logits (rows, vocab) float32 of the last scheduled token of each sequence, and of
        every prompt position of those that want the prompt's log-probabilities
        (``logit_rows`` says which row is which). ``wait_for_layer(l)`` runs before layer
        ``l`` reads the cache (layer-wise loads)."""
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
        histories: list[History] | None = None,
    ) -> Sampled:
        """Sample one token for each of ``seqs`` from ``logits[rows]``; ``masks[i]``, when
        given, is the bool mask of the tokens sequence ``i`` may take (a grammar's);
        ``histories[i]`` its tokens so far (penalties)."""
        sub = logits[torch.tensor(rows)] if len(rows) != logits.shape[0] else logits
        return self.sampler.run(sub.cpu(), [s.sampling for s in seqs], generators, masks,
                                histories)
