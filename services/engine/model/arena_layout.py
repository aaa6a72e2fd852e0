"""Float32 linear weights kept in the node's weight arena in oneDNN's blocked layout, so
that an engine computing on the arena's tensors computes as one that loaded its own copy.

A privately loaded float32 weight that oneDNN computes is packed once into its layout at
load (``linear.py:pack_float32``). A view of the arena holds the plain (out, in) weight:
oneDNN then reorders it on every call (measured here with one thread at 8 rows: 2048x768
1.30 ms plain against 0.89 ms packed, 60000x768 32 ms against 22 ms), and at one row it
takes another kernel whose bits differ from the packed one's, so a mapped model's tokens
could differ from a plain load's. Here the arena's region of such a weight holds the
packed bytes instead: the engine that fills it packs the weight and copies the packed
bytes in; every engine wraps the region as a oneDNN tensor (no copy) and computes on it.

    region (nbytes of the plain weight): | oneDNN's blocked layout of the weight |
    engine: an opaque oneDNN tensor over those bytes (its descriptor from
            ``_reorder_linear_weight`` of the same shape), kept alive with the arena

Which regions hold a packed form must be the same for every engine of the node (they map
one another's regions), so it depends only on the shape, the CPU and the torch build, the
same for every engine of a node: a float32 2-D linear weight that oneDNN computes whatever
the engine's thread count, whose packed layout takes exactly its plain bytes (the region's
size: hidden sizes in multiples of 16 do; a 3000-row head pads, stays plain). oneDNN
computes it in every engine when it has more than ``SMALL_GEMM_ELEMS`` elements, or when
MKL on one thread fails the row-invariance check for its shape (``linear.py``: only a
weight that passes goes to MKL, and only in a one-thread engine); a weight that passes
stays plain (MKL computes it plain in one-thread engines, oneDNN reorders it per call in
the others).

oneDNN's tensor over foreign memory is made by torch's AOTInductor C shim
(``aoti_torch_create_tensor_from_blob_v2``, mkldnn layout), the one interface that builds
one; a torch without it (or without oneDNN) keeps every region plain.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .linear import (
    _ONEDNN_LINEAR,
    _ONEDNN_REORDER,
    PACK_ROWS,
    SMALL_GEMM_ELEMS,
    small_gemm_rows_invariant,
)


class _Shim:
    """The C functions that wrap foreign bytes as a oneDNN tensor."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        self.create = lib.aoti_torch_create_tensor_from_blob_v2
        for name in ("aoti_torch_layout__mkldnn", "aoti_torch_dtype_float32",
                     "aoti_torch_device_type_cpu"):
            getattr(lib, name).restype = ctypes.c_int32
        self.layout = lib.aoti_torch_layout__mkldnn()
        self.dtype = lib.aoti_torch_dtype_float32()
        self.device = lib.aoti_torch_device_type_cpu()
        capsule = ctypes.pythonapi.PyCapsule_New
        capsule.restype = ctypes.py_object
        capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self.capsule = capsule

    def wrap(self, ptr: int, shape: tuple[int, int], md: bytes) -> torch.Tensor:
        sizes = (ctypes.c_int64 * 2)(*shape)
        strides = (ctypes.c_int64 * 2)(shape[1], 1)
        handle = ctypes.c_void_p()
        err = self.create(ctypes.c_void_p(ptr), ctypes.c_int64(2), sizes, strides,
                          ctypes.c_int64(0), ctypes.c_int32(self.dtype),
                          ctypes.c_int32(self.device), ctypes.c_int32(0),
                          ctypes.byref(handle), ctypes.c_int32(self.layout), md,
                          ctypes.c_int64(len(md)))
        if err or not handle.value:
            raise RuntimeError(f"torch could not wrap the arena's bytes as a oneDNN tensor "
                               f"({err})")
        # (the handle's reference passes to the Python tensor)
        return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(
            self.capsule(handle.value, None, None))


class ArenaLayouts:
    """oneDNN's layout (bytes, descriptor) of each float32 weight shape, found once per
    shape for the engine's life (one pack of a tensor of that shape): an engine pool's
    engine outlives its models, so a cold start finds them known."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[int, int], tuple[int, bytes] | None] = {}
        self._shim: _Shim | bool | None = None  # False: not available in this torch

    def _wrapper(self) -> _Shim | None:
        if self._shim is None:
            try:
                self._shim = _Shim() if _ONEDNN_LINEAR is not None else False
            except (OSError, AttributeError):
                self._shim = False
        return self._shim if isinstance(self._shim, _Shim) else None

    def _layout(self, shape: tuple[int, int]) -> tuple[int, bytes] | None:
        if shape not in self._layouts:
            self._layouts[shape] = None
            if _ONEDNN_REORDER is not None:
                try:
                    # (never written: untouched pages read as the kernel's zero page, so
                    # this costs the packed copy alone, not the plain one too)
                    packed = _ONEDNN_REORDER(torch.empty(shape), PACK_ROWS)
                    self._layouts[shape] = (int(torch.ops.mkldnn._nbytes(packed)), bytes(
                        torch.ops.mkldnn._get_mkldnn_serialized_md(packed).tolist()))
                except (RuntimeError, AttributeError):
                    pass
        return self._layouts[shape]

    def applies(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                bias: bool = False) -> bool:
        """Whether the arena holds engine tensor ``name`` (of ``shape``; its linear with a
        ``bias`` or not) packed."""
        if (dtype != torch.float32 or len(shape) != 2 or not _is_linear_weight(name)
                or self._wrapper() is None):
            return False
        out, inp = shape[0], shape[1]
        if out * inp <= SMALL_GEMM_ELEMS and _mkl_could_take(out, inp, bias):
            return False
        layout = self._layout((out, inp))
        return layout is not None and layout[0] == out * inp * 4

    def fill(self, region: torch.Tensor, plain: torch.Tensor) -> None:
        """Write ``plain``'s packed layout into ``region`` (uint8, its plain size)."""
        packed = _ONEDNN_REORDER(plain.contiguous(), PACK_ROWS)  # type: ignore[misc]
        n = int(torch.ops.mkldnn._nbytes(packed))
        assert n == region.numel()  # (``applies`` checked the shape's size)
        ctypes.memmove(region.data_ptr(), int(torch.ops.mkldnn.data_ptr(packed)), n)

    def view(self, region: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The oneDNN tensor over ``region``'s packed bytes (the caller keeps ``region``,
        and so the arena's mapping, alive as long as it)."""
        shim, layout = self._wrapper(), self._layout(shape)
        assert shim is not None and layout is not None  # (``applies`` said so)
        return shim.wrap(region.data_ptr(), shape, layout[1])


def _mkl_could_take(out: int, inp: int, bias: bool) -> bool:
    """Whether a one-thread engine computes an (out, inp) weight with MKL: its shape passes
    the row-invariance check on one thread (run on one thread whatever this engine's count,
    so that every engine of the node answers alike; the check looks at shapes, not
    values, and keeps its answer)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    threads = torch.get_num_threads()
    if threads == 1:
        return small_gemm_rows_invariant(w, b)
    torch.set_num_threads(1)  # (a load runs on the engine's worker, between no steps)
    try:
        return small_gemm_rows_invariant(w, b)
    finally:
        torch.set_num_threads(threads)


def _is_linear_weight(name: str) -> bool:
    """A weight a ``Linear`` computes (not the embedding table: the lookup reads it plain)."""
    return name == "lm_head" or name.rpartition(".")[2] in ("qkv_w", "o_w", "gate_up_w",
                                                            "down_w")
