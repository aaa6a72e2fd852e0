"""The async transfer engine's device seam (MIRAGE §4.1): copy a remapped layer's weights
from their host copy into a slot while the layers before it compute.

- CPU: one worker thread per engine runs the copies (``copy_`` releases the GIL, so the
  copy proceeds while the forward computes on the engine's thread); a ``Transfer`` is a
  future the forward waits on before it computes the layer.
- CUDA (written, untested: no GPU here): the copies are queued on a side stream from
  pinned host memory, an event recorded after them; the forward's stream waits on the
  event (no host sync), and the slot is not overwritten before the compute that reads it
  is done (an event recorded on the compute stream at ``release``). cuda-python is not
  needed: torch's own stream and event API suffices, imported lazily all the same.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch


class Transfer(Protocol):
    """One layer's copy into a slot."""

    def done(self) -> bool: ...

    def wait(self) -> None:
        """Return once the slot holds the layer (re-raises the copy's error)."""
        ...

    @property
    def seconds(self) -> float:
        """How long the copy took (valid after ``wait``)."""
        ...


class SlotCopier(Protocol):
    def submit(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Transfer: ...

    def close(self) -> None: ...


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    """Copy each ``src`` into its ``dst``; the seconds it took."""
    started = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    return time.perf_counter() - started


class _ThreadTransfer:
    def __init__(self, future: Future[float]) -> None:
        self._future = future
        self._seconds = 0.0

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._seconds = self._future.result()

    @property
    def seconds(self) -> float:
        return self._seconds


class ThreadCopier:
    """CPU: copies on one worker thread, in the order submitted."""

    def __init__(self, name: str = "overture-remap") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Transfer:
        return _ThreadTransfer(self._pool.submit(copy_all, dst, src))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _CudaTransfer:  # pragma: no cover - needs a GPU (untested)
    def __init__(self, done_event: Any, start_event: Any) -> None:
        self._done = done_event
        self._start = start_event

    def done(self) -> bool:
        return bool(self._done.query())

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._done)  # the compute waits, not the host

    @property
    def seconds(self) -> float:
        self._done.synchronize()
        return float(self._start.elapsed_time(self._done)) / 1000.0


class CudaCopier:  # pragma: no cover - needs a GPU (untested)
    """CUDA: copies on a side stream, ordered after the compute that last read the slot.
    The host copies must be pinned for the copy to be asynchronous."""

    def __init__(self, device: str) -> None:
        self._stream = torch.cuda.Stream(device=device)

    def submit(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Transfer:
        freed = torch.cuda.Event()
        freed.record(torch.cuda.current_stream())  # the slot's last reader is queued before
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(freed)
            start.record(self._stream)
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
            done.record(self._stream)
        return _CudaTransfer(done, start)

    def close(self) -> None:
        self._stream.synchronize()


def make_copier(device: str) -> SlotCopier:
    """The copier for the engine's device ("cpu" or "cuda[:n]")."""
    if device.startswith("cuda"):  # pragma: no cover - needs a GPU
        return CudaCopier(device)
    return ThreadCopier()
