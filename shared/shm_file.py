"""A sparse file in shared memory that several processes of a node map: the bytes behind the
engine's KV pool and behind the node's Reuse Store of weights.

Both need the same four things, so they share this one piece: memory committed only where
it is written (the file is sparse), pages handed back to the kernel in every process at once
(``MADV_REMOVE`` punches a hole in the file), the resident size read from the file itself,
and no file left behind by a process killed with SIGKILL. The owner holds an ``flock`` on
its file for its whole life; a later owner of the same prefix removes the files whose lock
nobody holds. flock works across PID namespaces (containers sharing /dev/shm), where a pid
in a file name means nothing.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

OS_PAGE = mmap.PAGESIZE
SHM_DIR = Path("/dev/shm")
CREATING_S = 60.0  # a file still being created is left alone this long


def shm_dir(directory: str | Path = "") -> Path:
    """``directory`` if given, else /dev/shm where it exists, else the temp folder."""
    if directory:
        return Path(directory)
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


def _unlocked(path: Path) -> bool:
    """Whether nobody holds ``path``'s lock: its owner is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # (gone meanwhile, or not ours to read)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # (drops the lock if it was taken)
    return True


def remove_stale_files(base: Path, prefix: str) -> list[Path]:
    """Unlink ``<prefix>-*`` files whose owner no longer holds their lock, and half-created
    ones a crash left; returns what was removed."""
    removed = []
    now = time.time()
    candidates = [*base.glob(f"{prefix}-*")]
    for path in base.glob(f".{prefix}-creating-*"):
        try:
            if now - path.stat().st_mtime > CREATING_S:
                candidates.append(path)
        except OSError:
            continue
    for path in candidates:
        if _unlocked(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("removed %d stale shared-memory file(s) of dead processes from %s",
                 len(removed), base)
    return removed


class ShmFile:
    """``nbytes`` of sparse shared memory under ``<directory>/<prefix>-<label>-<pid>-<id>``,
    mapped here for page control (``mm``); other processes map ``path``."""

    def __init__(self, nbytes: int, prefix: str, directory: str | Path = "",
                 label: str = "") -> None:
        base = shm_dir(directory)
        remove_stale_files(base, prefix)
        tag = "-".join(p for p in (label, str(os.getpid()), uuid.uuid4().hex[:12]) if p)
        self.path = base / f"{prefix}-{tag}"
        self.nbytes = nbytes
        # Created under a name the cleanup leaves alone, locked for this process's lifetime
        # (the lock is what tells a live file from a stale one), then given its name.
        creating = base / f".{prefix}-creating-{tag}"
        self._fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(creating, self.path)
        except BaseException:
            os.close(self._fd)
            creating.unlink(missing_ok=True)
            raise
        try:
            os.ftruncate(self._fd, nbytes)  # sparse: address space only, no memory yet
            self.mm = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise
        self._closed = False

    def allocate(self, offset: int, size: int) -> bool:
        """Back [offset, offset + size) with memory now, so running out shows up here rather
        than as a SIGBUS on a later write; False when the memory cannot be had."""
        try:
            os.posix_fallocate(self._fd, offset, size)
        except OSError as e:
            log.warning("cannot commit %d bytes in %s: %s", size, self.path, e.strerror)
            return False
        return True

    def punch(self, offset: int, size: int) -> None:
        """Return the whole OS pages of [offset, offset + size) to the kernel, in every
        process mapping the file; a range that is not page-aligned keeps its edge pages."""
        start = -(-offset // OS_PAGE) * OS_PAGE
        end = (offset + size) // OS_PAGE * OS_PAGE
        if end > start:
            self.mm.madvise(mmap.MADV_REMOVE, start, end - start)

    def resident_bytes(self) -> int:
        """Bytes of memory the file holds now (its committed pages)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        """Punch everything out first (other mappings may outlive this one, the memory is
        returned now), then unmap, unlock and unlink."""
        if self._closed:
            return
        self._closed = True
        self.punch(0, self.nbytes)
        self.mm.close()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)
