"""``python -m services.nodemgr`` / ``overture nodemgr``."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

from services.nodemgr.app import run
from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.engine_link import EngineUnavailable
from shared.aio import run_main
from shared.config import parse_service_args
from shared.logs import setup_logging

log = logging.getLogger(__name__)


async def _serve(config: NodeManagerConfig) -> int:
    """Run until SIGINT/SIGTERM, then leave ``run`` through its clean-up path."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await run(config)
    except asyncio.CancelledError:
        pass
    except EngineUnavailable as e:
        log.error("%s", e)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_service_args(
        NodeManagerConfig,
        "nodemgr",
        argv,
        "Overture node manager: registers the node with the scheduler and routes to its engine.",
    )
    setup_logging("nodemgr")
    try:
        return run_main(_serve(config))
    except KeyboardInterrupt:
        return 0
