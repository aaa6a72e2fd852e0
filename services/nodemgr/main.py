"""``python -m services.nodemgr`` / ``overture nodemgr``."""

from __future__ import annotations

from collections.abc import Sequence

from services.nodemgr.app import run
from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.engine_link import EngineUnavailable
from shared.service_main import service_main


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        NodeManagerConfig,
        "nodemgr",
        argv,
        "Overture node manager: registers the node with the scheduler and routes to its engine.",
        run,
        fatal=(EngineUnavailable,),
    )
