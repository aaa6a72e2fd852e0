"""Linear layers with a CPU-aware compute dtype.

On CPUs without native bf16/fp16 matrix instructions (AVX2-only, like the reference
machine) a half-precision GEMM costs about the same per row as a one-row (memory-bound)
GEMM, so its time grows linearly with the rows, while a float32 GEMM with a few rows
costs little more than one. A one-row step reads half the bytes in half precision and
wins there; from ``upcast_rows`` rows on, a half-precision linear is computed in float32
instead, against a float32 copy of the weights made once (converting the weights per call
would cost as much as the GEMM). The result is rounded back to the model dtype, so
callers never see the difference beyond rounding. The copy costs twice the half-precision
weight bytes, in host memory, for as long as the model lives.

Float32 GEMMs on CPU go through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the op
PyTorch's own CPU compiler emits for linears) rather than ``F.linear`` (MKL): it is faster
with the few rows of a decode step or a short prompt suffix, and no slower at 512 rows
(bench/README.md, "Engine speed"). Where the op is missing (a build without oneDNN) ``F.linear``
is used.

Float32 weights on CPU are also held in oneDNN's own blocked layout, packed once at load
(``pack_float32``), as PyTorch's CPU compiler does when it freezes a model: given a plain
weight, oneDNN reorders it on every call, a noticeable share of a short step with its
weights cold in cache (bench/README.md). The packed copy replaces the plain weight. Where the
plain one was made at load (a bf16 checkpoint served in float32, fused q/k/v and gate/up)
that adds no memory; a weight that was a zero-copy view of a float32 checkpoint's file
mapping becomes anonymous memory instead (its file pages are then only reclaimable cache).
A weight in the node's shared weight arena (the Reuse Store) is packed in the arena itself
instead, and computed on there (``arena_layout.py``, ``Linear.over_arena``).

Small float32 weights (the tiny demo models') in an engine with one intra-op thread go to
MKL (``F.linear``) instead: oneDNN costs ~40 us a call whatever the shape, 3-5x MKL's whole
call at these shapes (bench/README.md, "Several models"). A row's result must not depend on how many
rows share the GEMM (reused KV must equal recomputed KV bit for bit), and MKL computes one
to three rows with other kernels than four or more: such calls are padded to four rows, and
each weight shape is checked once, on the loading thread, to give every row the same bits
at every row count up to a prefill chunk (``small_gemm_rows_invariant``); a shape that
fails stays on oneDNN. With two threads MKL splits the rows between them and a row's bits
change with the split, so engines with more threads keep oneDNN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Measured on a 2-core AVX2 EPYC with float32 weight copies, demo "small" shapes: bf16
# and float32 are even at 2 rows, float32 wins from 3 rows on (at 32 rows 3-5x: gate_up
# 4096x768 11.2 ms bf16 vs 2.4 ms float32); at 1 row bf16 reads half the bytes.
UPCAST_ROWS_NO_NATIVE_HALF = 3


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return None

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return op(x, w, b, "none", [], "")

    return linear


_ONEDNN_LINEAR = _onednn_linear()
_ONEDNN_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)

# The row count oneDNN picks its weight layout for. Prompt suffixes of tens of tokens and
# decode batches are the GEMMs where the layout matters; at hundreds of rows the GEMM is
# compute-bound whatever the layout (a 512-row prefill chunk measured the same).
PACK_ROWS = 50


def pack_float32(w: torch.Tensor) -> torch.Tensor | None:
    """A float32 CPU weight (out, in) in oneDNN's blocked layout (an opaque tensor that
    only ``float32_linear`` can use), or None where that does not apply."""
    if (_ONEDNN_LINEAR is None or _ONEDNN_REORDER is None or w.device.type != "cpu"
            or w.dtype != torch.float32 or w.dim() != 2):
        return None
    try:
        return _ONEDNN_REORDER(w.contiguous(), PACK_ROWS)
    except RuntimeError:  # a oneDNN that cannot reorder this shape: keep the plain weight
        return None


def float32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) @ w^T + b, all float32: oneDNN on CPU when available. ``w`` may be
    plain or packed by ``pack_float32``."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu":
        return _ONEDNN_LINEAR(x, w, b)
    return F.linear(x, w, b)


# Float32 weights up to this many elements may use MKL (measured here: oneDNN/MKL us per
# call at 4 rows: 1024x64 78/32, 64x192 55/11; even at 576x576, oneDNN ahead from 768x768).
SMALL_GEMM_ELEMS = 1 << 17
SMALL_GEMM_MIN_ROWS = 4  # MKL's kernels for 1-3 rows differ from those for 4 and more
# The row-invariance check: a reference over this many rows (a default prefill chunk is
# 512), compared with calls over these row counts at its start and its end.
_PROBE_ROWS = 520
_PROBE_COUNTS = (*range(4, 20), 24, 31, 32, 33, 64, 100, 127, 128, 256, 257, 511, 512)
_invariant: dict[tuple[int, int, bool], bool] = {}


def small_gemm_rows_invariant(w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``F.linear`` on this thread gives each row of x @ w^T + b the same bits for
    every number of rows from four up to ``_PROBE_ROWS``, checked once per weight shape (MKL
    picks its kernels by shape, CPU and threads, not by values)."""
    key = (int(w.shape[0]), int(w.shape[1]), b is not None)
    if key not in _invariant:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(_PROBE_ROWS, key[1], generator=g, dtype=w.dtype)
        with torch.no_grad():
            ref = F.linear(x, w, b)
            _invariant[key] = all(
                torch.equal(F.linear(x[at:at + n], w, b), ref[at:at + n])
                for n in _PROBE_COUNTS for at in (0, _PROBE_ROWS - n))
    return _invariant[key]


def small_gemm_applies(w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """A float32 CPU weight small enough for MKL, on a thread with one intra-op thread, whose
    shape passed the row-invariance check."""
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and w.numel() <= SMALL_GEMM_ELEMS and torch.get_num_threads() == 1
            and small_gemm_rows_invariant(w, b))


def small_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               pad: torch.Tensor) -> torch.Tensor:
    """x (rows, in) @ w^T + b through MKL, with fewer than four rows padded to four in
    ``pad`` (SMALL_GEMM_MIN_ROWS, in), whose other rows may hold anything: a GEMM's output
    row depends on its input row only. (One copy into it costs a quarter of ``F.pad``'s
    new tensor, on every linear of a decode step.)"""
    rows = x.shape[0]
    if rows >= SMALL_GEMM_MIN_ROWS:
        return F.linear(x, w, b)
    pad[:rows] = x
    return F.linear(pad, w, b)[:rows]


def default_upcast_rows(dtype: torch.dtype, device: torch.device) -> int:
    """0 = never upcast (float32 models, GPUs, CPUs with native bf16 GEMMs)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    return UPCAST_ROWS_NO_NATIVE_HALF


class Linear:
    """A weight (out, in) and an optional bias (out,), shared with the owning module's
    parameters until ``pack`` replaces a float32 weight with its oneDNN layout; plus, for a
    half-precision weight, a float32 copy made (and packed) on the first call with enough
    rows."""

    __slots__ = ("_arena", "_b32", "_packed", "_pad", "_small", "_w32", "b", "w")

    def __init__(self, w: torch.Tensor | None, b: torch.Tensor | None) -> None:
        self.w: torch.Tensor | None = w
        self.b = b
        self._packed: torch.Tensor | None = None
        # The node's arena bytes a packed weight lives in (arena_layout.py): kept alive
        # with it, and not this linear's own memory.
        self._arena: torch.Tensor | None = None
        self._small = False  # computed by ``small_gemm`` (chosen by ``choose_kernel``)
        self._pad: torch.Tensor | None = None  # small_gemm's rows (a model runs on one thread)
        self._w32: torch.Tensor | None = None
        self._b32: torch.Tensor | None = None

    def choose_kernel(self, copy: bool = True) -> bool:
        """Compute this float32 weight with MKL from now on where ``small_gemm_applies``
        (call it on the thread that will run the model, before ``pack``; the choice is for
        the weight's life: one weight, one kernel, whatever the rows). True if chosen: the
        weight is then a copy in anonymous memory (the owner must take ``w`` in place of
        its own), as a packed one is. A zero-copy view of the checkpoint's file would be
        page cache, which the kernel may page out while the model is idle (this host's
        DAMON does, after seconds) and read back from disk on its next step. ``copy``
        False: a view into the node's shared weight arena (shared memory, not file cache)
        stays the weight computed on."""
        if self.w is not None and self._packed is None and small_gemm_applies(self.w, self.b):
            self._small = True
            if copy:
                self.w = self.w.clone()
            self._pad = torch.zeros(SMALL_GEMM_MIN_ROWS, self.w.shape[1], dtype=self.w.dtype)
        return self._small

    @classmethod
    def over_arena(cls, packed: torch.Tensor, b: torch.Tensor | None,
                   region: torch.Tensor) -> Linear:
        """A linear computed on a weight packed in the node's arena (``packed``, a oneDNN
        tensor over ``region``'s bytes: arena_layout.py), as a packed one of its own."""
        lin = cls(None, b)
        lin._packed, lin._arena = packed, region
        return lin

    def like(self, w: torch.Tensor, b: torch.Tensor | None) -> Linear:
        """A linear over ``w`` and ``b`` (plain tensors of this one's shapes: a remapped
        layer's slot, engine/remap/) computed by the same kernel as this one, so that a
        layer computed in the slot gives the bits it gives resident. A packed weight's
        slot holds it plain: oneDNN computes a plain float32 weight as it does its packed
        layout."""
        lin = Linear(w, b)
        if self._small:
            lin._small = True
            lin._pad = torch.zeros(SMALL_GEMM_MIN_ROWS, w.shape[1], dtype=w.dtype)
        return lin

    @property
    def on_mkl(self) -> bool:
        """Whether ``choose_kernel`` gave this weight to MKL."""
        return self._small

    def pack(self) -> bool:
        """Hold a float32 CPU weight in oneDNN's layout only (the plain one is dropped:
        the owner must drop its reference too for the memory to be freed). False where
        there is nothing to pack (a weight computed by MKL stays plain)."""
        if self.w is None:
            return self._packed is not None
        if self._small:
            return False
        packed = pack_float32(self.w)
        if packed is None:
            return False
        self._packed, self.w = packed, None
        return True

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain (out, in) tensor (a dense copy when packed)."""
        if self.w is not None:
            return self.w
        assert self._packed is not None
        return self._packed.to_dense()

    def __call__(self, x: torch.Tensor, upcast_rows: int) -> torch.Tensor:
        """x (rows, in) @ w^T + b -> (rows, out) in x's dtype."""
        if self._packed is not None:
            return float32_linear(x, self._packed, self.b)
        w = self.w
        assert w is not None
        if self._small:
            assert self._pad is not None  # (made with the choice)
            return small_gemm(x, w, self.b, self._pad)
        if w.dtype == torch.float32:
            return float32_linear(x, w, self.b)
        if upcast_rows and x.shape[0] >= upcast_rows:
            w32, b32 = self.float32_weights()
            return float32_linear(x.float(), w32, b32).to(x.dtype)
        return F.linear(x, w, self.b)

    def float32_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The half-precision weight's float32 copy (packed for oneDNN where it can be)."""
        if self._w32 is None:
            assert self.w is not None
            with torch.no_grad():
                w32 = self.w.detach().float().contiguous()
                self._w32 = pack_float32(w32)
                if self._w32 is None:
                    self._w32 = w32
                self._b32 = None if self.b is None else self.b.detach().float()
        return self._w32, self._b32

    def release_float32(self) -> None:
        self._w32 = self._b32 = None

    @property
    def unshared_bytes(self) -> int:
        """Host bytes this linear holds outside its owner's parameters: the packed weight
        (its plain parameter was dropped) and the float32 copies."""
        packed = self._packed
        own = packed.numel() * packed.element_size() if packed is not None and \
            self._arena is None else 0
        return own + self.float32_bytes

    @property
    def float32_bytes(self) -> int:
        """Host bytes held by the float32 copies (0 until the first upcast call)."""
        return sum(t.numel() * t.element_size() for t in (self._w32, self._b32) if t is not None)
