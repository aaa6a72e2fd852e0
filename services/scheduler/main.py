"""``python -m services.scheduler`` / ``overture scheduler``."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence

from services.scheduler.app import run
from services.scheduler.config import SchedulerConfig
from shared.aio import run_main
from shared.config import parse_service_args
from shared.logs import setup_logging


async def _serve(config: SchedulerConfig) -> None:
    """Run until SIGINT/SIGTERM, then leave ``run`` through its clean-up path."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await run(config)
    except asyncio.CancelledError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_service_args(
        SchedulerConfig,
        "scheduler",
        argv,
        "Overture scheduler: the public OpenAI-compatible API and the cluster's node registry.",
    )
    setup_logging("scheduler")
    try:
        run_main(_serve(config))
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0
