"""The Reuse Store's arena in GPU memory with CUDA's virtual memory management (Tangram
§4 allocates the pool with cudaMalloc and shares it by CUDA IPC; VMM lets the node commit
only what resident tensors need, as the CPU arena's sparse file does).

    cuMemAddressReserve(nbytes)                  once: address space for the arena
    commit(region): for each granule it touches and nobody mapped yet:
        cuMemCreate(granule, exportable as a POSIX fd) -> cuMemMap -> cuMemSetAccess
    release(region): granules no region uses any more: cuMemUnmap -> cuMemRelease
    move(src, dst): cuMemcpyDtoD (compaction)
    handles(): (offset, fd) per granule, for an engine to cuMemImportFromShareableHandle
               and map at the same offsets of its own reservation

    serve_handles(socket): the fds, over a Unix socket (SCM_RIGHTS), to each engine that
               asks; the arena's path becomes "cuda:<dev>@<socket>", which the engine's
               ``services/engine/cuda_weights.py:import_arena`` maps

UNTESTED: no machine this project runs on has a GPU. The nodemgr opens this arena when
``nodemgr.weights_device`` is "cuda" (``arena.py:open_arena``, its choice unit-tested with
a stand-in for this class); the CUDA calls themselves have never run.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any


def _driver() -> Any:
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:  # older cuda-python
        from cuda import cuda as driver
    return driver


def _check(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != _driver().CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


class CudaVmmArena:
    def __init__(self, nbytes: int, device_index: int = 0) -> None:
        drv = self._drv = _driver()
        _check(drv.cuInit(0))
        dev = _check(drv.cuDeviceGet(device_index))
        self._ctx = _check(drv.cuDevicePrimaryCtxRetain(dev))
        _check(drv.cuCtxSetCurrent(self._ctx))
        prop = self._prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        prop.requestedHandleTypes = \
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.granule = int(_check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self.nbytes = -(-nbytes // self.granule) * self.granule
        self.path = f"cuda:{device_index}"  # (engines import handles(), not a path)
        self._va = int(_check(drv.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
        self._access = drv.CUmemAccessDesc()
        self._access.location = prop.location
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._handles: dict[int, Any] = {}  # granule offset -> physical allocation
        self._users: dict[int, int] = {}  # granule offset -> regions touching it

    def _granules(self, offset: int, size: int) -> range:
        first = offset // self.granule * self.granule
        return range(first, offset + size, self.granule)

    def commit(self, offset: int, size: int) -> None:
        drv = self._drv
        for off in self._granules(offset, size):
            self._users[off] = self._users.get(off, 0) + 1
            if off in self._handles:
                continue
            handle = _check(drv.cuMemCreate(self.granule, self._prop, 0))
            _check(drv.cuMemMap(self._va + off, self.granule, 0, handle, 0))
            _check(drv.cuMemSetAccess(self._va + off, self.granule, [self._access], 1))
            self._handles[off] = handle

    def release(self, offset: int, size: int) -> None:
        for off in self._granules(offset, size):
            left = self._users.get(off, 0) - 1
            if left > 0:
                self._users[off] = left
                continue
            self._users.pop(off, None)
            if off in self._handles:
                _check(self._drv.cuMemUnmap(self._va + off, self.granule))
                _check(self._drv.cuMemRelease(self._handles.pop(off)))

    def move(self, src: int, dst: int, size: int) -> None:
        self.commit(dst, size)
        _check(self._drv.cuMemcpyDtoD(self._va + dst, self._va + src, size))
        self.release(src, size)

    def handles(self) -> list[tuple[int, int]]:
        """(offset, POSIX fd) of every mapped granule, for the engines to import."""
        fd_type = self._drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return [(off, int(_check(self._drv.cuMemExportToShareableHandle(h, fd_type, 0))))
                for off, h in sorted(self._handles.items())]

    def serve_handles(self, sock_path: str) -> None:
        """Answer engines on the Unix socket ``sock_path`` (a thread): per connection a
        JSON line {"granule", "offsets"}, then each granule's fd in that order."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(sock_path)
        server.listen()
        self._server = server
        self.path = f"{self.path.partition('@')[0]}@{sock_path}"

        def loop() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:  # (closed)
                    return
                with conn:
                    shared = self.handles()
                    try:
                        conn.sendall(json.dumps({"granule": self.granule, "offsets": [
                            off for off, _ in shared]}).encode() + b"\n")
                        fds = [fd for _, fd in shared]
                        for i in range(0, len(fds), 250):  # (SCM_MAX_FD is 253)
                            socket.send_fds(conn, [b"f"], fds[i:i + 250])
                    except OSError:
                        pass  # (the engine went away: its activation fails on its side)
                    finally:
                        for _, fd in shared:
                            os.close(fd)

        threading.Thread(target=loop, name="weight-arena-handles", daemon=True).start()

    def resident_bytes(self) -> int:
        return len(self._handles) * self.granule

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()
            os.unlink(server.getsockname())
        for off in list(self._handles):
            _check(self._drv.cuMemUnmap(self._va + off, self.granule))
            _check(self._drv.cuMemRelease(self._handles.pop(off)))
        _check(self._drv.cuMemAddressFree(self._va, self.nbytes))
