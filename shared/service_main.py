"""The ``main()`` every service shares: parse config, set up logging, run until a signal.

Start-up failures the operator can fix (bad config, unloadable model, locked RocksDB) are
logged as one line and exit with status 2 instead of a traceback, so a supervisor does not
crash-loop on them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from shared.aio import run_main
from shared.cluster_config import ClusterConfig, start_internal_auth
from shared.config import ConfigError, load, parse_service_args
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
        _cluster_membership(config, section, argv)
    except ConfigError as e:
        log.error("%s cannot start: %s", section, e)
        return 2
    try:
        return run_main(_serve(section, run, config, (ConfigError, *fatal)))
    except KeyboardInterrupt:
        return 0


def _cluster_membership(config: Any, section: str, argv: Sequence[str] | None) -> None:
    """Read the ``cluster:`` section (the same file and environment as the service's own)
    and set up internal authentication. Raises ``ConfigError``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    yaml_path = pre.parse_known_args(argv)[0].config
    cluster = load(ClusterConfig, "cluster", yaml_path=yaml_path, env=os.environ)
    # The address others reach this service's internal endpoints on.
    host = getattr(config, "grpc_host", None) or getattr(config, "host", "")
    start_internal_auth(cluster, section, str(host))
