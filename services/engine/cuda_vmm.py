"""Elastic KV pool memory on a GPU with CUDA's virtual memory management (Prism §5.1,
kvcached): reserve the whole budget as address space once, back it with physical memory
page by page as the pool grows, and give pages back as it shrinks, so the engines of a
GPU share its memory on demand.

    cuMemAddressReserve(budget)              once: address space only
    commit(page):  cuMemCreate(granule) -> cuMemMap(va + off) -> cuMemSetAccess(rw)
    release(page): cuMemUnmap(va + off) -> cuMemRelease(handle)

UNTESTED: written against cuda-python's driver API (``cuda.bindings.driver``, or the older
``cuda.cuda``), but no machine this project is developed or tested on has a GPU; CPU runs
use ``device.SharedMemoryFile``, whose commit/release (fallocate, MADV_REMOVE) the tests
exercise. Pages must be multiples of the allocation granularity (2 MiB on current GPUs:
``engine.page_bytes``' default). The pool cannot be shared with the kvstore process by IPC
handle in this mode (each physical chunk would need its own exported handle); the kvstore
then serves this engine by recompute-or-copy paths only.
"""

from __future__ import annotations

from typing import Any

import torch


def _driver() -> Any:
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:  # older cuda-python
        from cuda import cuda as driver
    return driver


def _check(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


class _DeviceBytes:
    """Exposes a raw device range to torch (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


class CudaVmmMemory:
    def __init__(self, nbytes: int, device: str = "cuda") -> None:
        drv = _driver()
        index = torch.device(device).index or 0
        torch.cuda.init()
        self._drv = drv
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self.granule = int(_check(drv.cuMemGetAllocationGranularity(
            self._prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self.nbytes = -(-nbytes // self.granule) * self.granule
        self._va = int(_check(drv.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
        self._access = drv.CUmemAccessDesc()
        self._access.location = self._prop.location
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._handles: dict[int, Any] = {}  # offset -> physical allocation
        self.tensor = torch.as_tensor(_DeviceBytes(self._va, self.nbytes), device=device)

    @property
    def name(self) -> str:
        return ""  # (no IPC handle for a VMM range: see the module docstring)

    def commit(self, offset: int, nbytes: int) -> bool:
        drv = self._drv
        done: list[int] = []
        try:
            for off in range(offset, offset + nbytes, self.granule):
                handle = _check(drv.cuMemCreate(self.granule, self._prop, 0))
                _check(drv.cuMemMap(self._va + off, self.granule, 0, handle, 0))
                _check(drv.cuMemSetAccess(self._va + off, self.granule, [self._access], 1))
                self._handles[off] = handle
                done.append(off)
        except RuntimeError:  # out of device memory: undo this commit, report exhaustion
            for off in done:
                self._unmap(off)
            return False
        return True

    def release(self, offset: int, nbytes: int) -> None:
        for off in range(offset, offset + nbytes, self.granule):
            if off in self._handles:
                self._unmap(off)

    def _unmap(self, off: int) -> None:
        _check(self._drv.cuMemUnmap(self._va + off, self.granule))
        _check(self._drv.cuMemRelease(self._handles.pop(off)))

    def resident_bytes(self) -> int:
        return len(self._handles) * self.granule

    def close(self) -> None:
        for off in list(self._handles):
            self._unmap(off)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        _check(self._drv.cuMemAddressFree(self._va, self.nbytes))
