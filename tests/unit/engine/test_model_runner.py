"""The runner's batch packing: slots and flat K rows of every (layer, token), the same from
the Python path (decode steps) and the tensor path (larger steps)."""

from __future__ import annotations

import pytest
import torch

from services.engine import model_runner
from services.engine.api_types import SamplingParams
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import Sequence

BS = 4
LAYERS = 3


def _seq(rid: str, prompt: int, computed: int, tables: list[list[int]]) -> Sequence:
    s = Sequence(rid, list(range(100, 100 + prompt)), SamplingParams(), b"", 999, 0, LAYERS)
    s.num_computed_tokens = computed
    s.block_tables = tables
    return s


def _step() -> tuple[SchedulerOutput, list[tuple[Sequence, int, int]]]:
    """A decode at position 9, a chunk of 6 tokens from position 2, a whole prompt of 3."""
    a = _seq("a", 10, 9, [[7, 3, 11], [1, 2, 4], [20, 21, 22]])
    b = _seq("b", 8, 2, [[5, 6], [8, 9], [30, 31]])
    c = _seq("c", 3, 0, [[12], [13], [14]])
    out = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 6, "c": 3}, sequences=[a, b, c])
    return out, [(a, 9, 1), (b, 2, 6), (c, 0, 3)]


@pytest.mark.parametrize("python_slots", [0, 10**6])
def test_slots_and_kv_rows_follow_the_block_tables(monkeypatch, python_slots: int) -> None:
    monkeypatch.setattr(model_runner, "PYTHON_SLOTS", python_slots)
    runner = ModelRunner(torch.nn.Identity(), torch.zeros(40, 2, BS, 1, 2), LAYERS, BS)
    out, spans = _step()
    batch = runner.build_batch(out)
    want_slots, want_rows, ids, pos = [], [], [], []
    for layer in range(LAYERS):
        slots, rows = [], []
        for s, start, n in spans:
            for p in range(start, start + n):
                block = s.block_tables[layer][p // BS]
                slots.append(block * BS + p % BS)
                rows.append(block * 2 * BS + p % BS)
        want_slots.append(slots)
        want_rows.append(rows)
    for s, start, n in spans:
        ids += s.token_ids[start:start + n]
        pos += list(range(start, start + n))
    assert [t.tolist() for t in batch.slot_mapping] == want_slots
    assert batch.kv_rows is not None and batch.kv_rows.tolist() == want_rows
    assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
    assert batch.q_lens == [1, 6, 3] and batch.kv_lens == [10, 8, 3]
    assert batch.logits_indices.tolist() == [0, 6, 9]
    # Tables padded with block 0 to the longest.
    assert batch.block_tables[1].tolist() == [[1, 2, 4], [8, 9, 0], [13, 0, 0]]
