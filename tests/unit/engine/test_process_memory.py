"""The engine process's resident memory: smaps read into parts, and only clean library
pages ever dropped (a written page would lose its bytes)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from services.engine import process_memory as pm

SMAPS = """\
7f0000000000-7f0000010000 r-xp 00000000 08:01 11 /usr/lib/libtorch_cpu.so
Rss:                  40 kB
Anonymous:             0 kB
7f0000010000-7f0000012000 r--p 00010000 08:01 11 /usr/lib/libtorch_cpu.so
Rss:                   8 kB
Anonymous:             8 kB
7f0000012000-7f0000013000 rw-p 00012000 08:01 11 /usr/lib/libtorch_cpu.so
Rss:                   4 kB
Anonymous:             4 kB
7f0000020000-7f0000030000 r-xp 00000000 08:01 12 /usr/lib/libmkl_core.so.2
Rss:                  64 kB
Anonymous:             0 kB
7f0000040000-7f0000050000 r--p 00000000 08:01 13 /m/model.safetensors
Rss:                  16 kB
Anonymous:             0 kB
560000000000-560000100000 rw-p 00000000 00:00 0 [heap]
Rss:                1024 kB
Anonymous:          1024 kB
7f0000060000-7f0000070000 rw-p 00000000 00:00 0
Rss:                  32 kB
Anonymous:            32 kB
"""


def test_smaps_parts_and_which_mappings_may_be_dropped(tmp_path: Path) -> None:
    f = tmp_path / "smaps"
    f.write_text(SMAPS)
    maps = pm.mappings(f)
    assert [m.rss // 1024 for m in maps] == [40, 8, 4, 64, 16, 1024, 32]
    # only read-only library pages with nothing copied on write: never relocated data,
    # never writable data, never a weight file or anonymous memory
    assert [pm.droppable(m) for m in maps] == [True, False, False, True, False, False, False]
    parts = pm.breakdown(f)
    assert parts["torch libraries"] == 52 << 10
    assert parts["math libraries"] == 64 << 10
    assert parts["weight files"] == 16 << 10
    assert parts["heap and anonymous"] == 1056 << 10


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_dropping_library_pages_leaves_the_process_working() -> None:
    """The pages of torch's libraries leave RSS and come back as they run again: the same
    results after as before, and no written page lost (its data would read back wrong)."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    before = (x @ x.T).sum().item()
    written = ctypes.create_string_buffer(b"kept", 4096)
    held = sum(m.rss for m in pm.mappings() if pm.droppable(m))
    dropped = pm.drop_library_pages()
    assert 0 < dropped <= held
    assert sum(m.rss for m in pm.mappings() if pm.droppable(m)) < held
    assert (x @ x.T).sum().item() == before
    assert written.value == b"kept"
