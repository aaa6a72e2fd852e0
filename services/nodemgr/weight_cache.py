"""Keep the catalogue's weight files in the node's page cache (Prism §5.2: activation
loads weights from host memory, not disk).

Each model's ``*.safetensors`` files are mapped once per node, read-only and shared, and
the kernel is asked to read them in (``MADV_WILLNEED``). An engine activating the model
maps the same files and finds their pages resident: ``bench.multimodel.activation``
measures the difference. The page cache stays the kernel's to manage: under memory pressure it may
still drop pages, and activation then reads them from disk; ``cached_bytes`` asks the kernel
how much of a model's files is still there (``mincore``), for the node's residency report.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
from pathlib import Path

from shared.model_catalog import ModelEntry

log = logging.getLogger(__name__)


class WeightCache:
    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def hold(self, entries: tuple[ModelEntry, ...]) -> int:
        """Map (and start reading) every weight file of ``entries``; bytes held."""
        total = 0
        for entry in entries:
            for f in sorted(Path(entry.path).glob("*.safetensors")):
                if f in self._maps:
                    continue
                try:
                    with f.open("rb") as fh:
                        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as e:
                    log.warning("weight cache: cannot map %s: %s", f, e)
                    continue
                if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                    m.madvise(mmap.MADV_WILLNEED)
                self._maps[f] = m
                total += len(m)
        if total:
            log.info("weight cache: %d MiB of weights mapped for %d models", total >> 20,
                     len(entries))
        return total

    def cached_bytes(self, entry: ModelEntry) -> int | None:
        """Bytes of ``entry``'s weight files in the page cache now; None: not measurable
        here (no ``mincore``)."""
        total = 0
        for f in sorted(Path(entry.path).glob("*.safetensors")):
            n = page_cached_bytes(f)
            if n is None:
                return None
            total += n
        return total

    @property
    def bytes(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


_LOW_BIT = bytes(b & 1 for b in range(256))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    except (OSError, AttributeError):
        return None
    return libc


def page_cached_bytes(path: Path) -> int | None:
    """Bytes of the file at ``path`` the page cache holds (``mincore`` on a fresh read-only
    mapping, which touches no page); None when the kernel cannot say."""
    libc = _libc()
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            page = mmap.PAGESIZE
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(addr, size, vec) != 0:
                return None
            resident = vec.raw.translate(_LOW_BIT).count(1)  # (bit 0: in the cache)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * page)
