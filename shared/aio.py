"""Event-loop entry point shared by the services."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_main(coro: Coroutine[Any, Any, T]) -> T:
    """Run a service's top-level coroutine on uvloop (falls back to asyncio's loop)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def freeze_startup_heap() -> None:
    """Take everything alive once a service is up (modules, the model, a tier's index) out
    of the garbage collector's sight, once per process, when it is ready to serve.

    CPython's full collection walks every tracked object: ~210k of them in an engine or a
    kvstore here, ~125 ms a pass. Such a pass fires now and then from ordinary request
    churn, and a 125 ms stall in the middle of a KV load or a forward pass is a TTFT
    spike. Frozen objects are never collected, which is what start-up state wants (it
    lives as long as the process); later garbage is collected as usual. Not for test
    processes that build and drop many services: their frozen cycles would leak.
    """
    gc.collect()
    gc.freeze()


def raise_if_cancel_requested() -> None:
    """Re-raise a cancellation something below swallowed.

    A retry loop that outlives every error can outlive its own cancellation when a library
    turns the CancelledError into an error of its own (grpc.aio may report a cancelled
    call as CANCELLED) or drops it (Python 3.11's ``asyncio.wait_for`` returns the result
    when the awaited future finished in the same pass as the cancel). The task's cancel
    request stays counted (``Task.cancelling()``): such a loop calls this each round so it
    stops when asked."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
