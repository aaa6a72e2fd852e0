"""What both sides of ``bench.engine.speed`` run: the batch sizes and their prompts, and
the peak-RSS reading each side's process reports."""

from __future__ import annotations

import resource

import torch

BATCHES = (1, 8, 32)


def prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + batch)
    # Skip the lowest ids (special tokens) so no prompt contains an EOS or BOS.
    return torch.randint(16, vocab, (batch, prompt_len), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
