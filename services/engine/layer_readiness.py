"""Per-request, per-layer readiness of KV being loaded into the pool (Symphony §3.4).

The kvstore copies a request's reused prefix into its pool blocks layer by layer, lowest
first, while the forward pass already runs; the pass calls ``wait(l)`` before layer ``l``
reads the cache. Written from the event loop (``mark_loaded``, ``fail``, ``finish``), read
from the engine's worker thread (``wait``), so it is a small monitor on a Condition.

    layers:   0  1  2  3  4  5  6  7
    state:    ok ok ok ok .. .. .. ..     loaded_through = 3: wait(0..3) returns at once
              ok ok X  (failed_from = 2)  wait(l) returns False for l >= 2, at once

A failure is final and covers that layer and every later one. ``finished`` says the RPC has
ended (no more writes into the blocks can happen), which is when the blocks may be reused.
"""

from __future__ import annotations

import threading
import time


class LayerReadiness:
    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._loaded_through = -1  # highest layer l such that 0..l are all loaded
        self._failed_from: int | None = None
        self.error = ""
        self._finished = False
        self.created = time.perf_counter()
        self.completed_at = 0.0  # when the last layer became resident

    # ---- writers (event loop) -----------------------------------------------------------
    def mark_loaded(self, layer: int) -> None:
        """Layer ``layer`` is resident. Layers must arrive in order; a gap is a failure."""
        with self._cond:
            if self._failed_from is not None:
                return
            if layer != self._loaded_through + 1:
                self._fail_locked(self._loaded_through + 1, f"layer {layer} arrived out of order")
            else:
                self._loaded_through = layer
                if layer == self.num_layers - 1:
                    self.completed_at = time.perf_counter()
            self._cond.notify_all()

    def fail(self, layer: int, error: str) -> None:
        """Layers ``layer..`` will not be loaded (corrupt/missing chunk, RPC error, timeout)."""
        with self._cond:
            self._fail_locked(layer, error)
            self._cond.notify_all()

    def _fail_locked(self, layer: int, error: str) -> None:
        layer = max(0, min(layer, self._loaded_through + 1))
        if self._failed_from is None or layer < self._failed_from:
            self._failed_from = layer
            self.error = error

    def finish(self) -> None:
        """The load RPC has ended; anything not loaded by now never will be."""
        with self._cond:
            self._finished = True
            if self._loaded_through < self.num_layers - 1:
                self._fail_locked(self._loaded_through + 1, self.error or "load ended early")
            self._cond.notify_all()

    # ---- readers (worker thread) --------------------------------------------------------
    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` is resident (True) or will never be (False). After
        ``timeout`` seconds without an answer the layer and later ones count as failed."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._resolved(layer), timeout)
            if not ok:
                self._fail_locked(layer, f"layer {layer} not loaded within {timeout} s")
            return self._failed_from is None or layer < self._failed_from

    def _resolved(self, layer: int) -> bool:
        return layer <= self._loaded_through or (
            self._failed_from is not None and layer >= self._failed_from
        )

    @property
    def loaded_through(self) -> int:
        """The highest layer ``l`` with layers ``0..l`` all loaded (-1: none)."""
        with self._cond:
            if self._failed_from is not None:
                return min(self._loaded_through, self._failed_from - 1)
            return self._loaded_through

    @property
    def complete(self) -> bool:
        """Every layer loaded."""
        with self._cond:
            return self._loaded_through == self.num_layers - 1

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._failed_from is not None

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._finished
