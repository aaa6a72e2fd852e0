"""The device seam for the Reuse Store's weight arena: on CPU the nodemgr's file mapped
shared (no cuda-python imported); a CUDA arena's granule handles go from the nodemgr to
the engine over a Unix socket (SCM_RIGHTS), which runs here with ordinary files in place
of the granules' fds (the CUDA import itself is untested: no GPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from services.engine.cuda_weights import parse_path, receive_handles
from services.engine.device import map_weight_arena
from services.nodemgr.reuse_store.cuda_arena import CudaVmmArena


def test_a_cpu_arena_is_the_file_mapped_shared(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    path.write_bytes(bytes(range(256)) * 16)
    arena = map_weight_arena(str(path), 4096)
    assert arena.dtype == torch.uint8 and arena.numel() == 4096 and int(arena[5]) == 5
    arena[7] = 99  # (shared: the file sees it)
    assert path.read_bytes()[7] == 99
    assert "cuda.bindings" not in sys.modules and "cuda.cuda" not in sys.modules


def test_cuda_arena_paths() -> None:
    assert parse_path("cuda:1@/run/x.sock") == (1, "/run/x.sock")
    with pytest.raises(ValueError, match="cuda:<dev>@<socket>"):
        parse_path("cuda:0")


def test_granule_handles_cross_from_the_nodemgr_to_the_engine(tmp_path: Path) -> None:
    files = [tmp_path / f"g{i}" for i in range(3)]
    for f in files:
        f.write_bytes(b"x")
    arena = CudaVmmArena.__new__(CudaVmmArena)  # (no GPU: only its handle server)
    arena.granule, arena.path = 2 << 20, "cuda:0"

    def handles() -> list[tuple[int, int]]:
        return [(i * arena.granule, os.open(f, os.O_RDONLY)) for i, f in enumerate(files)]

    arena.handles = handles  # type: ignore[method-assign]
    sock = str(tmp_path / "h.sock")
    arena.serve_handles(sock)
    try:
        assert arena.path == f"cuda:0@{sock}"
        granule, got = receive_handles(parse_path(arena.path)[1])
        assert granule == 2 << 20 and [off for off, _ in got] == [0, 2 << 20, 4 << 20]
        for (_, fd), f in zip(got, files, strict=True):
            assert os.fstat(fd).st_ino == f.stat().st_ino
            os.close(fd)
    finally:
        arena._server.close()
        os.unlink(sock)
