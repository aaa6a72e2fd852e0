"""A model's weight files in or out of the kernel's page cache, the set-up that tells a
load from disk from one from host memory (``activation``, ``model_loading``)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_from_page_cache(folder: Path) -> None:
    """The next read of the folder's weight files comes from disk (written back first,
    then posix_fadvise DONTNEED)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_page_cache(folder: Path) -> None:
    """The next read of the folder's weight files comes from host memory."""
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            while fh.read(16 << 20):
                pass
