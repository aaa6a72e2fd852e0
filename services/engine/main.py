"""``python -m services.engine`` / ``overture engine``."""

from __future__ import annotations

from collections.abc import Sequence

from shared.service_main import service_main

from .config import EngineConfig
from .errors import EngineError
from .model import LoaderError
from .service import run


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        EngineConfig,
        "engine",
        argv,
        "Overture engine: runs a Llama-family model with a paged per-layer KV pool.",
        run,
        fatal=(LoaderError, EngineError),
    )
