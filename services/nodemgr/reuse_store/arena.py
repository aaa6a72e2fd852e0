"""The Unified Memory Pool's bytes (Tangram §3.1): one arena per node that every engine
maps, so that a tensor resident once is computed on by every engine that needs it.

On CPU the arena is a sparse file in shared memory (/dev/shm), created and owned by the
nodemgr, mapped by each engine with ``UntypedStorage.from_file(shared=True)``: an engine
tensor is a view into that mapping, no copy. Memory is committed as tensors are written
and returned when they are evicted (``MADV_REMOVE`` punches the pages out), so an arena
sized to the node's whole budget holds only what is resident; the node's device ledger
counts those bytes against the budget that KV pages share (§3.3).

On CUDA the same arena would be device memory reserved with the VMM API and shared with
the engines by exported handles (see ``cuda_arena.py``, UNTESTED). ``open_arena`` is the
nodemgr's side of the device seam: it picks the arena by the engines' device
(``nodemgr.weights_device``); the engine's side is ``engine/device.py:map_weight_arena``,
which maps whichever the arena's path names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from shared.shm_file import ShmFile


class Arena(Protocol):
    """Bytes the store places tensors in. ``path``: what engines map (with ``nbytes``)."""

    path: str
    nbytes: int

    def commit(self, offset: int, size: int) -> None: ...
    def move(self, src: int, dst: int, size: int) -> None: ...
    def release(self, offset: int, size: int) -> None: ...
    def resident_bytes(self) -> int: ...
    def close(self) -> None: ...


class ShmArena:
    """The CPU arena: a sparse shared-memory file (``shared/shm_file.py``); a nodemgr killed
    with SIGKILL leaves it behind, and the next one on the host removes it."""

    def __init__(self, nbytes: int, directory: str = "", tag: str = "") -> None:
        self._file = ShmFile(nbytes, "overture-weights", directory, label=tag)
        self.path = str(self._file.path)
        self.nbytes = nbytes

    def commit(self, offset: int, size: int) -> None:
        """Nothing to do: a tmpfs page is committed when an engine first writes it."""

    def view(self, offset: int, size: int) -> memoryview:
        """The arena's bytes [offset, offset + size) (tests and the bench read them)."""
        return memoryview(self._file.mm)[offset:offset + size]

    def move(self, src: int, dst: int, size: int) -> None:
        """Compaction: copy a tensor's bytes to its new region (``mmap.move`` is memmove:
        overlapping ranges are safe) and return the pages it left behind."""
        self._file.mm.move(dst, src, size)
        if dst + size <= src:
            self.release(src, size)
        elif dst < src:
            self.release(dst + size, src - dst)

    def release(self, offset: int, size: int) -> None:
        """Return the whole OS pages of [offset, offset + size) to the kernel."""
        self._file.punch(offset, size)

    def resident_bytes(self) -> int:
        """Bytes of memory the arena's file holds now (its committed pages)."""
        return self._file.resident_bytes()

    def close(self) -> None:
        self._file.close()


def open_arena(device: str, nbytes: int, directory: str = "", tag: str = "") -> Arena:
    """The node's arena on ``device`` (the engines' ``engine.device``): "cpu" a
    ``ShmArena``; "cuda" or "cuda:<n>" the VMM arena of ``cuda_arena.py`` (UNTESTED: no GPU
    here), its handles served on a Unix socket in ``directory`` (as the CPU arena's file;
    '' = /dev/shm), which its path then names for the engines. cuda-python is imported
    only then, by the CUDA arena itself."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return ShmArena(nbytes, directory, tag)
    if kind != "cuda" or not (index or "0").isdigit():
        raise ValueError(f"nodemgr.weights_device: {device!r} is not a device the weight "
                         "arena can live on; use 'cpu', 'cuda' or 'cuda:<n>' (as engine.device)")
    # (a CPU node never loads the CUDA arena's module)
    from services.nodemgr.reuse_store.cuda_arena import CudaVmmArena

    arena = CudaVmmArena(nbytes, int(index or 0))
    sock = Path(directory or "/dev/shm") / f"overture-weights-{tag or 'node'}-{os.getpid()}.sock"
    try:
        arena.serve_handles(str(sock))
    except BaseException:
        arena.close()
        raise
    return arena
