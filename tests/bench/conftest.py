"""Smoke runs of the benchmarks: each bench's real ``main`` on its smallest settings (tiny
demo models, one repetition, a second of load), its output checked for the tables and
ratios it prints, never for their numbers (they are whatever this machine does in a few
seconds). Those of ten seconds or more (a cluster of their own, most of them) are marked
``slow``: ``-m "not slow"`` leaves some twenty seconds' worth. A bench that changes
something process-wide (torch's thread count, an environment variable, a signal handler)
has it restored by a fixture here.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Restores torch's intra-op thread count (benches of one engine set it to 1)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sigterm_handler() -> Iterator[None]:
    """Restores the SIGTERM handler (a cluster bench turns SIGTERM into an exit)."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)
