"""The Unified Memory Pool's bytes (Tangram §3.1): one arena per node that every engine
maps, so that a tensor resident once is computed on by every engine that needs it.

On CPU the arena is a sparse file in shared memory (/dev/shm), created and owned by the
nodemgr, mapped by each engine with ``UntypedStorage.from_file(shared=True)``: an engine
tensor is a view into that mapping, no copy. Memory is committed as tensors are written
and returned when they are evicted (``MADV_REMOVE`` punches the pages out), so an arena
sized to the node's whole budget holds only what is resident; the node's device ledger
counts those bytes against the budget that KV pages share (§3.3).

On CUDA the same arena would be device memory reserved with the VMM API and shared with
the engines by exported handles (see ``cuda_arena.py``, UNTESTED).
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import uuid
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
OS_PAGE = mmap.PAGESIZE


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
    def __init__(self, nbytes: int, directory: str = "", tag: str = "") -> None:
        base = Path(directory) if directory else (
            SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir()))
        name = f"overture-weights-{tag or os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = str(base / name)
        self.nbytes = nbytes
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(self._fd, nbytes)  # sparse: address space only
            self._mm = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            os.unlink(self.path)
            raise
        self._closed = False

    def commit(self, offset: int, size: int) -> None:
        """Nothing to do: a tmpfs page is committed when an engine first writes it."""

    def view(self, offset: int, size: int) -> memoryview:
        """The arena's bytes [offset, offset + size) (tests and the bench read them)."""
        return memoryview(self._mm)[offset:offset + size]

    def move(self, src: int, dst: int, size: int) -> None:
        """Compaction: copy a tensor's bytes to its new region (``mmap.move`` is memmove:
        overlapping ranges are safe); the pages left behind are released by the caller's
        bookkeeping (``release`` of the range the tensor no longer covers)."""
        self._mm.move(dst, src, size)
        if dst + size <= src:
            self.release(src, size)
        elif dst < src:
            self.release(dst + size, src - dst)

    def release(self, offset: int, size: int) -> None:
        """Return the whole OS pages of [offset, offset + size) to the kernel."""
        start = -(-offset // OS_PAGE) * OS_PAGE
        end = (offset + size) // OS_PAGE * OS_PAGE
        if end > start:
            self._mm.madvise(mmap.MADV_REMOVE, start, end - start)

    def resident_bytes(self) -> int:
        """Bytes of memory the arena's file holds now (its committed pages)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.release(0, self.nbytes)
        self._mm.close()
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
