"""The ``main()`` every service shares: parse config, set up logging, run until a signal.

Start-up failures the operator can fix (bad config, unloadable model, locked RocksDB) are
logged as one line and exit with status 2 instead of a traceback, so a supervisor does not
crash-loop on them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from shared.aio import run_main
from shared.config import ConfigError, parse_service_args
from shared.logs import setup_logging

C = TypeVar("C")

log = logging.getLogger(__name__)


async def _serve(
    name: str,
    run: Callable[[Any], Awaitable[Any]],
    config: Any,
    fatal: tuple[type[BaseException], ...],
) -> int:
    """Run ``run(config)`` until SIGINT/SIGTERM cancels it through its clean-up path."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await run(config)
    except asyncio.CancelledError:
        log.info("%s stopped", name)
    except fatal as e:
        log.error("%s cannot start: %s", name, e)
        return 2
    return 0


def service_main(
    config_cls: type[C],
    section: str,
    argv: Sequence[str] | None,
    description: str,
    run: Callable[[C], Awaitable[Any]],
    fatal: tuple[type[BaseException], ...] = (),
) -> int:
    """Entry point of ``python -m services.<section>``; returns the process exit status."""
    config = parse_service_args(config_cls, section, argv, description)
    setup_logging(section)
    try:
        return run_main(_serve(section, run, config, (ConfigError, *fatal)))
    except KeyboardInterrupt:
        return 0
