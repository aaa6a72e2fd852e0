"""The device seam: where the KV pool's bytes live. Everything device-specific is here.

``PoolMemory`` is one flat byte range that the pool views as its KV tensor, plus the two
operations elastic capacity needs (kvcached-style, DESIGN §5): *commit* a byte range so
writes to it are backed by real memory, and *release* it so that memory goes back to the
node. A ``name`` lets another process on the node map the same bytes (the kvstore writes
restored KV straight into the pool).

- CPU: a file in shared memory (``/dev/shm``) mapped shared. Commit = ``posix_fallocate``
  (tmpfs pages are allocated now, so running out shows up here, not as a SIGBUS later);
  release = ``madvise(MADV_REMOVE)``, which punches a hole: the pages leave RSS and the
  file, in every process that maps it.
- CUDA: torch allocates the whole reservation on the device; commit and release are
  accounting only (the memory stays with torch's allocator) and ``name`` is a CUDA IPC
  handle. cuda-python is imported only there, on first use.
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
from typing import Protocol

import torch

log = logging.getLogger(__name__)

OS_PAGE = mmap.PAGESIZE
SHM_DIR = Path("/dev/shm")


class PoolMemory(Protocol):
    """Backing bytes of the KV pool.

    ``tensor`` is a flat uint8 tensor of ``nbytes``. ``commit``/``release`` take byte ranges
    inside it; ``commit`` returns False (never raises) when the memory cannot be had, which
    callers treat as "out of blocks". Nothing may use a released range until re-committed.
    ``close`` frees everything; the tensor must not be used afterwards.
    """

    tensor: torch.Tensor

    @property
    def name(self) -> str: ...

    def commit(self, offset: int, nbytes: int) -> bool: ...

    def release(self, offset: int, nbytes: int) -> None: ...

    def resident_bytes(self) -> int: ...

    def close(self) -> None: ...


CREATING_S = 60.0  # a pool file still being created is left alone this long


def _unlocked(path: Path) -> bool:
    """Whether nobody holds ``path``'s lock: its owner is gone. flock works across PID
    namespaces (containers sharing /dev/shm), where a pid in a file name means nothing."""
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
    """Unlink ``<prefix>-*`` pool files whose owner no longer holds their lock (an engine
    killed with SIGKILL cannot remove its own), and half-created ones left by a crash;
    returns what was removed."""
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
        log.info("removed %d stale KV pool file(s) of dead processes from %s", len(removed), base)
    return removed


class SharedMemoryFile:
    """CPU pool memory: a sparse file under /dev/shm, mapped shared by torch."""

    def __init__(self, nbytes: int, prefix: str = "overture-kv") -> None:
        base = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
        remove_stale_files(base, prefix)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = base / f"{prefix}-{tag}"
        self.name = str(self.path)
        self.nbytes = nbytes
        # Created under a name the cleanup leaves alone, locked for this process's lifetime
        # (the lock is what tells a live pool from a stale one), then given its name.
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
            os.ftruncate(self._fd, nbytes)  # sparse: reserves address space, no memory yet
            # A second, private-to-us mapping of the same file, used only for madvise.
            self._mm = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED)
            storage = torch.UntypedStorage.from_file(self.name, shared=True, nbytes=nbytes)
            # (torch's stubs type from_file's result as the base storage class)
            self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise
        self._closed = False

    def commit(self, offset: int, nbytes: int) -> bool:
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as e:
            log.warning("cannot commit %d KV bytes in %s: %s", nbytes, self.name, e.strerror)
            return False
        return True

    def release(self, offset: int, nbytes: int) -> None:
        # Only whole OS pages can be punched out; a range that is not page-aligned keeps
        # its partial edge pages (the pool sizes pages to avoid that).
        start = -(-offset // OS_PAGE) * OS_PAGE
        end = (offset + nbytes) // OS_PAGE * OS_PAGE
        if end > start:
            self._mm.madvise(mmap.MADV_REMOVE, start, end - start)

    def resident_bytes(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Punch out everything first: torch's own mapping may outlive us until the tensor
        # is garbage-collected, but the memory is returned now.
        self.release(0, self.nbytes)
        self._mm.close()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


class CudaMemory:
    """CUDA pool memory: one torch allocation; pages are accounting only."""

    def __init__(self, nbytes: int, device: str = "cuda") -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self._name = ""

    @property
    def name(self) -> str:
        """A CUDA IPC handle (hex) another process can open with cudaIpcOpenMemHandle."""
        if not self._name:
            from cuda import cudart  # lazy: only CUDA deployments install cuda-python

            err, handle = cudart.cudaIpcGetMemHandle(self.tensor.data_ptr())
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaIpcGetMemHandle failed: {err}")
            self._name = bytes(handle.reserved).hex()
        return self._name

    def commit(self, offset: int, nbytes: int) -> bool:
        return True

    def release(self, offset: int, nbytes: int) -> None:
        return None

    def resident_bytes(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)


def map_weight_arena(path: str, nbytes: int) -> torch.Tensor:
    """The node's Reuse Store arena (Tangram §3.1) as a flat uint8 tensor this engine views
    its weights in: on CPU the nodemgr's shared-memory file mapped shared; a path
    ``cuda:<dev>@<socket>`` is the nodemgr's CUDA arena, its granules imported
    (``cuda_weights.py``, untested: no GPU here)."""
    if path.startswith("cuda:"):
        from .cuda_weights import import_arena  # lazy: cuda-python only where CUDA is

        return import_arena(path, nbytes)
    storage = torch.UntypedStorage.from_file(path, True, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]


def allocate_pool_memory(device: str, nbytes: int, elastic: bool = False) -> PoolMemory:
    """The pool memory for ``device`` ("cpu" or "cuda[:n]"); ``elastic`` on CUDA: pages
    backed on demand with the virtual memory API (``cuda_vmm.py``, untested: no GPU here)."""
    if device == "cpu":
        return SharedMemoryFile(nbytes)
    if device.startswith("cuda"):
        if elastic:
            from .cuda_vmm import CudaVmmMemory  # lazy: cuda-python only where CUDA is

            return CudaVmmMemory(nbytes, device)
        return CudaMemory(nbytes, device)
    raise ValueError(f"unknown device {device!r}; known: cpu, cuda")
