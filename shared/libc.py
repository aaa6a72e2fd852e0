"""glibc's malloc controls and ``madvise`` through ctypes (elsewhere, e.g. musl, every
malloc call is a no-op)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from typing import Any


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> bool:
    """Hand the heap's free memory back to the kernel (after a load freed large buffers,
    which glibc otherwise keeps for reuse). True if anything was released."""
    libc = glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` (None without a C library that has it)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def drop_mapped_pages(address: int, length: int) -> bool:
    """``madvise(MADV_DONTNEED)`` over a private, never-written file mapping: its resident
    pages leave the process (a later read maps them again from the page cache), so a file
    read once at load stops counting in RSS while its mapping lives. The range is widened
    to whole pages. True if the kernel took it."""
    fn = _madvise()
    if fn is None or length <= 0:
        return False
    page = mmap.PAGESIZE
    start = address - address % page
    return bool(fn(start, length + (address - start), mmap.MADV_DONTNEED) == 0)
