"""``python -m services.engine`` / ``overture engine``."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

from shared.aio import run_main
from shared.config import ConfigError, parse_service_args
from shared.logs import setup_logging

from .config import EngineConfig
from .errors import EngineError
from .model import LoaderError
from .service import run

log = logging.getLogger(__name__)


async def _serve(config: EngineConfig) -> int:
    """Run until SIGINT/SIGTERM, then leave ``run`` through its clean-up path."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await run(config)
    except asyncio.CancelledError:
        log.info("engine stopped")
    except (ConfigError, LoaderError, EngineError) as e:
        log.error("engine cannot start: %s", e)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_service_args(
        EngineConfig,
        "engine",
        argv,
        "Overture engine: runs a Llama-family model with a paged per-layer KV pool.",
    )
    setup_logging("engine")
    try:
        return run_main(_serve(config))
    except KeyboardInterrupt:
        return 0
