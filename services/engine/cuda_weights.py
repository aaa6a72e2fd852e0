"""The engine's side of the Reuse Store's weight arena on a GPU (Tangram §3.1, §4: the pool
is shared across processes; here with CUDA's virtual memory management rather than one
cudaMalloc'd block shared by CUDA IPC, so the node commits only what resident tensors use).

    nodemgr: CudaVmmArena (reuse_store/cuda_arena.py), path "cuda:<dev>@<socket>"
        each committed granule exported as a POSIX fd, sent over the Unix socket
        (SCM_RIGHTS) to an engine that asks
    engine:  import_arena(path, nbytes)
        cuMemAddressReserve(nbytes)   its own address space, the arena's size
        per granule: cuMemImportFromShareableHandle(fd) -> cuMemMap(va + offset)
                     -> cuMemSetAccess(rw)          (same offsets as the nodemgr's)
        a flat uint8 torch tensor over it, which ``model/mapped.py`` views tensors in

Only the granules committed when the engine asks are mapped: the nodemgr commits every
tensor of an activation before it sends Activate, and an active model's tensors neither
move nor go, so the engine never needs a later one. The mapping lasts as long as the
tensor (and every view of it): then the engine unmaps and releases its imports, and the
nodemgr's release frees the physical memory once neither side maps it.

UNTESTED: no machine this project runs on has a GPU. cuda-python is imported only here,
only when an arena's path names a CUDA device.
"""

from __future__ import annotations

import json
import os
import socket
import weakref
from typing import Any

import torch

from .cuda_vmm import _check, _DeviceBytes, _driver

MAX_FDS = 250  # file descriptors per message (the kernel's SCM_MAX_FD is 253)


def parse_path(path: str) -> tuple[int, str]:
    """(device index, handle socket) of a CUDA arena's path ``cuda:<dev>@<socket>``."""
    device, sep, sock = path.partition("@")
    kind, _, index = device.partition(":")
    if kind != "cuda" or not sep or not sock:
        raise ValueError(f"not a CUDA weight arena: {path!r} (expected cuda:<dev>@<socket>)")
    return int(index or 0), sock


def receive_handles(sock_path: str) -> tuple[int, list[tuple[int, int]]]:
    """The arena's granule size and (offset, fd) of every committed granule, asked of the
    nodemgr's handle socket: a JSON line {"granule", "offsets"}, then the fds in order."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock_path)
        header = b""
        while not header.endswith(b"\n"):
            chunk = s.recv(1)
            if not chunk:
                raise ConnectionError("the weight arena's handle socket closed early")
            header += chunk
        meta = json.loads(header)
        offsets: list[int] = meta["offsets"]
        fds: list[int] = []
        try:
            while len(fds) < len(offsets):
                _, got, _, _ = socket.recv_fds(s, 16, min(MAX_FDS, len(offsets) - len(fds)))
                if not got:
                    raise ConnectionError("the weight arena's handle socket sent too few fds")
                fds += got
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    return int(meta["granule"]), list(zip(offsets, fds, strict=True))


def _unmap(drv: Any, va: int, nbytes: int, granule: int,
           mapped: list[tuple[int, Any]]) -> None:
    for off, handle in mapped:
        _check(drv.cuMemUnmap(va + off, granule))
        _check(drv.cuMemRelease(handle))
    mapped.clear()
    _check(drv.cuMemAddressFree(va, nbytes))


def import_arena(path: str, nbytes: int) -> torch.Tensor:
    """The node's CUDA weight arena as a flat uint8 tensor of this process, mapped at the
    nodemgr's offsets; unmapped once the tensor and every view of it are gone."""
    device_index, sock = parse_path(path)
    granule, handles = receive_handles(sock)
    drv = _driver()
    _check(drv.cuInit(0))
    size = -(-nbytes // granule) * granule
    va = int(_check(drv.cuMemAddressReserve(size, 0, 0, 0)))
    access = drv.CUmemAccessDesc()
    access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device_index
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    mapped: list[tuple[int, Any]] = []
    try:
        for i, (off, fd) in enumerate(handles):
            try:
                handle = _check(drv.cuMemImportFromShareableHandle(fd, fd_type))
            finally:
                os.close(fd)  # (the import holds the allocation now)
                handles[i] = (off, -1)
            _check(drv.cuMemMap(va + off, granule, 0, handle, 0))
            mapped.append((off, handle))
            _check(drv.cuMemSetAccess(va + off, granule, [access], 1))
    except BaseException:
        for _, fd in handles:
            if fd >= 0:
                os.close(fd)
        _unmap(drv, va, size, granule, mapped)
        raise
    tensor = torch.as_tensor(_DeviceBytes(va, size), device=f"cuda:{device_index}")
    # (views' base is this tensor: it lives while any of the model's weights does)
    weakref.finalize(tensor, _unmap, drv, va, size, granule, mapped)
    return tensor
