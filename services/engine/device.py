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

from pathlib import Path
from typing import Protocol

import torch

from shared.shm_file import ShmFile


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


class SharedMemoryFile:
    """CPU pool memory: a sparse file under /dev/shm (``shared/shm_file.py``), mapped shared
    by torch as the pool's tensor."""

    def __init__(self, nbytes: int, prefix: str = "overture-kv",
                 directory: str | Path = "") -> None:
        self._file = ShmFile(nbytes, prefix, directory)
        self.path = self._file.path
        self.name = str(self.path)
        self.nbytes = nbytes
        try:
            storage = torch.UntypedStorage.from_file(self.name, shared=True, nbytes=nbytes)
            # (torch's stubs type from_file's result as the base storage class)
            self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        except BaseException:
            self._file.close()
            raise

    def commit(self, offset: int, nbytes: int) -> bool:
        return self._file.allocate(offset, nbytes)

    def release(self, offset: int, nbytes: int) -> None:
        # (the pool sizes its pages to whole OS pages, so nothing is kept at the edges)
        self._file.punch(offset, nbytes)

    def resident_bytes(self) -> int:
        return self._file.resident_bytes()

    def close(self) -> None:
        # torch's own mapping may outlive us until the tensor is garbage-collected, but the
        # memory is returned now.
        self._file.close()


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
