"""glibc's malloc controls through ctypes (elsewhere, e.g. musl, every call is a no-op)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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
