"""``python -m services.scheduler`` / ``overture scheduler``."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.app import run
from services.scheduler.config import SchedulerConfig
from shared.service_main import service_main


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        SchedulerConfig,
        "scheduler",
        argv,
        "Overture scheduler: the public OpenAI-compatible API and the cluster's node registry.",
        run,
    )
