"""Event-loop entry point shared by the services."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_main(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a service's top-level coroutine on uvloop (falls back to asyncio's loop)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return asyncio.run(coro)
    return uvloop.run(coro)
