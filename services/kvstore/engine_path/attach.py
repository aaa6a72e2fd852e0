"""Mapping the engine's KV pool into the kvstore process (the same-node data path).

The engine owns ONE tensor for all layers (services/engine/kvcache/device_memory.py)::

    kv_cache: (num_blocks, 2, block_size, num_kv_heads, head_dim)   # [:,0]=K, [:,1]=V

- CPU: the pool lives in a shared-memory file; we open it and ``mmap`` it ``MAP_SHARED``,
  so our writes are the engine's reads (no copy through gRPC or a socket).
- CUDA: the pool's name is a CUDA IPC handle; it is opened lazily with cuda-python, only
  when a CUDA pool is attached (the seam: nothing else in the kvstore knows the device).

The kvstore never commits or releases pool pages: the engine only names blocks that are
committed and pinned for the duration of a call.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import tempfile
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.kvstore.engine_path.copies import lazy_torch
from services.kvstore.manifests.manifest import MAX_MODEL_LAYERS
from shared.chunk_codec import DTYPE_NAMES, ChunkFormatError, chunk_key
from shared.config import ConfigError
from shared.kv_layout import block_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class PoolError(ValueError):
    """An AttachPool/pool_id request that cannot be served (bad geometry, unknown pool)."""


@dataclass(frozen=True)
class PoolGeometry:
    pool_name: str  # CPU: shm file path; CUDA: IPC handle hex
    device: str  # "cpu" | "cuda[:n]"
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    num_layers: int
    model_fp: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(lazy_torch(), self.dtype)

    @property
    def block_bytes(self) -> int:
        """K and V of one layer for ``block_size`` tokens."""
        return block_bytes(self.block_size, self.num_kv_heads, self.head_dim,
                           self.torch_dtype.itemsize)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def validate(self) -> None:
        if not self.pool_name:
            raise PoolError("pool.pool_name is empty")
        if self.dtype not in DTYPE_NAMES:
            raise PoolError(f"pool.dtype {self.dtype!r} unknown; known: {', '.join(DTYPE_NAMES)}")
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, name) < 1:
                raise PoolError(f"pool.{name} must be >= 1, got {getattr(self, name)}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise PoolError(f"pool.device {self.device!r} unknown; known: cpu, cuda")
        if self.num_layers > MAX_MODEL_LAYERS:
            raise PoolError(f"pool.num_layers must be <= {MAX_MODEL_LAYERS}, got {self.num_layers}")
        try:
            chunk_key("t", self.model_fp, b"\0", 0)  # a name chunk keys can carry
        except ChunkFormatError as e:
            raise PoolError(f"pool.model_fp: {e}") from None


class MappedPool:
    """One attached pool: ``kv`` is the (num_blocks, 2, bs, kvh, hd) tensor over its memory."""

    def __init__(self, pool_id: str, geometry: PoolGeometry, kv: torch.Tensor, closer: Any) -> None:
        self.pool_id = pool_id
        self.geometry = geometry
        self.kv = kv
        self._closer = closer
        self._host_bytes: memoryview | None = None
        self.identity: tuple[int, int] | None = None  # the CPU pool file's (dev, inode)

    @property
    def host_bytes(self) -> memoryview | None:
        """The pool's memory as writable bytes (block ``b`` at ``b * block_bytes``) when it
        is host memory, for reads straight into blocks; None for a device pool."""
        if self._host_bytes is None and self.kv.device.type == "cpu" and self.kv.numel():
            flat = self.kv.view(-1).view(lazy_torch().uint8)
            self._host_bytes = flat.numpy().data.cast("B")
        return self._host_bytes

    def check_model(self, model_fp: str, num_layers: int) -> None:
        """A request names this pool's model and at most its layers (its KV would be
        stored under another model's keys otherwise, or the work it asks be unbounded)."""
        g = self.geometry
        if model_fp != g.model_fp:
            raise PoolError(f"model_fp {model_fp[:80]!r} is not the pool's ({g.model_fp!r})")
        if not 1 <= num_layers <= g.num_layers:
            raise PoolError(f"num_layers must be in [1, {g.num_layers}] (the pool's), got "
                            f"{num_layers}")

    def check_block_ids(self, block_ids: list[int]) -> None:
        n = self.geometry.num_blocks
        bad = next((b for b in block_ids if not 0 <= b < n), None)
        if bad is not None:
            raise PoolError(f"block id {bad} is outside the pool [0, {n})")

    def close(self) -> None:
        self.kv = lazy_torch().empty(0, dtype=self.geometry.torch_dtype)
        self._host_bytes = None
        if self._closer is not None:
            self._closer()
            self._closer = None


# Where engines create CPU pools (services/engine/device.py: /dev/shm, else the temp dir)
# and how they name them. AttachPool maps nothing else: a pool is read and written by
# SaveFromPool and LoadIntoPool, so an arbitrary path would be an arbitrary-file write.
POOL_DIRS = ("/dev/shm", tempfile.gettempdir())
POOL_FILE_PREFIX = "overture-kv-"


def _check_pool_path(name: str) -> None:
    # Compared as given, normalized: "/dev/shm/x/../overture-kv-y" would pass a check of
    # the normalized text while the kernel resolves x first (a symlink anywhere).
    parent, base = os.path.split(name)
    if (os.path.normpath(name) != name or parent not in POOL_DIRS
            or not base.startswith(POOL_FILE_PREFIX)):
        raise PoolError(
            f"pool file {name!r} is not an engine pool: expected {POOL_FILE_PREFIX}* in "
            f"{' or '.join(POOL_DIRS)}")


def file_identity(name: str) -> tuple[int, int] | None:
    """(device, inode) of the pool file, None if it is gone: a file re-created under the
    same name (another engine) is another pool."""
    try:
        st = os.stat(name, follow_symlinks=False)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _map_cpu(geometry: PoolGeometry) -> tuple[torch.Tensor, Any, tuple[int, int] | None]:
    need = geometry.num_blocks * geometry.block_bytes
    _check_pool_path(geometry.pool_name)
    try:
        fd = os.open(geometry.pool_name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise PoolError(f"cannot open pool file {geometry.pool_name!r}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # (a hard link: a file elsewhere)
            raise PoolError(f"pool file {geometry.pool_name!r} is not a regular file of its own")
        size = st.st_size
        if size < need:
            raise PoolError(
                f"pool file {geometry.pool_name!r} has {size} bytes; the geometry needs {need}"
            )
        mm = mmap.mmap(fd, need, flags=mmap.MAP_SHARED)
        _populate_committed(fd, mm, need)
    finally:
        os.close(fd)  # the mapping keeps the file alive
    torch = lazy_torch()
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=need)
    kv = flat.view(geometry.torch_dtype).view(geometry.shape)

    identity = (st.st_dev, st.st_ino)

    def close() -> None:
        # Never mm.close() here: torch.frombuffer does not hold a buffer export, so closing
        # would leave any tensor view still in use by an in-flight copy pointing at unmapped
        # memory (a segfault, not a BufferError). Dropping our references lets the mapping
        # go when the last view dies (each view keeps ``mm`` alive).
        nonlocal flat
        del flat

    return kv, close, identity


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def _populate_committed(fd: int, mm: mmap.mmap, size: int) -> None:
    """Map, up front, the pool pages the engine has already committed.

    Without it the first copy into each 4 KiB page page-faults in this process (the
    engine's own faults do not count here): a 2k-token load of the demo model is 12k
    faults, ~40 ms of CPU on the reference VM, right when the forward pass needs the
    cores. Only the file's data ranges (SEEK_DATA/SEEK_HOLE) are populated, i.e. pages
    the engine has written: touching a hole would commit memory it has not asked for, and
    tmpfs reports committed-but-unwritten pages as holes too (those fault lazily). Best
    effort: an old kernel or a file system without SEEK_DATA just faults as before.
    """
    off = 0
    try:
        while off < size:
            start = os.lseek(fd, off, os.SEEK_DATA)
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            mm.madvise(_MADV_POPULATE_WRITE, start, end - start)
            off = end
    except OSError:  # ENXIO: no data after ``off``; EINVAL: populate not supported
        return


class _CudaArray:
    """``__cuda_array_interface__`` over a raw device pointer, so torch can view it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
        }


def _map_cuda(geometry: PoolGeometry) -> tuple[torch.Tensor, Any, tuple[int, int] | None]:
    from cuda import cudart  # lazy: only CUDA deployments install cuda-python

    handle = cudart.cudaIpcMemHandle_t()
    try:
        handle.reserved = bytes.fromhex(geometry.pool_name)
    except ValueError as e:
        raise PoolError(f"pool.pool_name is not a hex CUDA IPC handle: {e}") from None
    err, ptr = cudart.cudaIpcOpenMemHandle(handle, cudart.cudaIpcMemLazyEnablePeerAccess)
    if err != cudart.cudaError_t.cudaSuccess:
        raise PoolError(f"cudaIpcOpenMemHandle failed: {err}")
    nbytes = geometry.num_blocks * geometry.block_bytes
    torch = lazy_torch()
    flat = torch.as_tensor(_CudaArray(int(ptr), nbytes), device=geometry.device)
    kv = flat.view(geometry.torch_dtype).view(geometry.shape)

    def close() -> None:
        cudart.cudaIpcCloseMemHandle(ptr)

    return kv, close, None


class PoolRegistry:
    """Attached pools by id; one mapping per pool name. ``close`` unmaps everything."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._by_id: dict[str, MappedPool] = {}
        self._by_name: dict[str, str] = {}

    def blocks_per_chunk(self, block_size: int) -> int:
        if self.chunk_tokens % block_size:
            raise ConfigError(
                f"kvstore.chunk_tokens: {self.chunk_tokens} is not a multiple of the pool's "
                f"block_size {block_size}; set it to a multiple (e.g. {16 * block_size})"
            )
        return self.chunk_tokens // block_size

    def attach(self, geometry: PoolGeometry) -> MappedPool:
        """Map the pool (or return the existing mapping of the same name and geometry)."""
        geometry.validate()
        self.blocks_per_chunk(geometry.block_size)
        self._drop_vanished()
        known = self._by_name.get(geometry.pool_name)
        if known is not None and self._by_id[known].identity != self._identity(geometry):
            self._detach(self._by_id[known])  # the name now names another engine's pool
            known = None
        if known is not None:
            pool = self._by_id[known]
            if pool.geometry != geometry:
                raise PoolError(
                    f"pool {geometry.pool_name!r} is attached with another geometry "
                    f"({pool.geometry}); a re-attach must describe the same pool"
                )
            return pool
        mapper = _map_cpu if geometry.device == "cpu" else _map_cuda
        kv, closer, identity = mapper(geometry)
        pool = MappedPool(f"pool-{uuid.uuid4().hex[:12]}", geometry, kv, closer)
        pool.identity = identity  # of the file mapped, not of whatever has the name now
        self._by_id[pool.pool_id] = pool
        self._by_name[geometry.pool_name] = pool.pool_id
        log.info("attached KV pool %s as %s: %s", geometry.pool_name, pool.pool_id, geometry)
        return pool

    def get(self, pool_id: str) -> MappedPool:
        pool = self._by_id.get(pool_id)
        if pool is None:
            raise PoolError(f"unknown pool_id {pool_id!r}; call AttachPool first")
        return pool

    def by_model(self, model_fp: str) -> MappedPool | None:
        """The most recently attached pool of ``model_fp`` (lookups carry no pool id)."""
        self._drop_vanished()
        for pool in reversed(self._by_id.values()):
            if pool.geometry.model_fp == model_fp:
                return pool
        return None

    @staticmethod
    def _identity(geometry: PoolGeometry) -> tuple[int, int] | None:
        return file_identity(geometry.pool_name) if geometry.device == "cpu" else None

    def _drop_vanished(self) -> None:
        # An engine that exited removed its shm file (or another one re-created the name):
        # drop our mapping of it too.
        for pool in list(self._by_id.values()):
            if pool.geometry.device == "cpu" and self._identity(pool.geometry) != pool.identity:
                self._detach(pool)

    def _detach(self, pool: MappedPool) -> None:
        self._by_id.pop(pool.pool_id, None)
        self._by_name.pop(pool.geometry.pool_name, None)
        pool.close()
        log.info("detached KV pool %s", pool.pool_id)

    def close(self) -> None:
        for pool in list(self._by_id.values()):
            self._detach(pool)

    def check_integrity(self) -> None:
        assert len(self._by_id) == len(self._by_name), "pool id and name maps disagree"
        for name, pid in self._by_name.items():
            assert self._by_id[pid].geometry.pool_name == name, "pool name map is stale"
