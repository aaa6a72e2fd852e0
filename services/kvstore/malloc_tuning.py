"""Keep glibc malloc from handing chunk-sized buffers back to the kernel after each use.

The kvstore allocates and frees a buffer per chunk read (RocksDB values, S3 bodies, peer
messages; 0.25-2 MiB each). By default glibc serves such sizes with a fresh ``mmap`` or
trims the heap top once 2x that much is free, so the next read page-faults all of it back
in (several times the cost of the read itself; the kvstore README). A fixed mmap
threshold above chunk sizes and a trim threshold the size of a few layers keep that memory
in the process for reuse; the DRAM tier's byte budget still bounds what is live.
"""

from __future__ import annotations

import logging

from shared.libc import glibc

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit; chunks are far smaller
TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Apply the thresholds (glibc only; elsewhere a no-op). True if applied."""
    libc = glibc()
    if libc is None:  # not glibc (musl has no mallopt)
        return False
    mallopt = libc.mallopt
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.debug("mallopt refused the kvstore's thresholds; keeping glibc defaults")
    return ok
