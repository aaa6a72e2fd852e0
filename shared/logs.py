"""Logging set-up for a service process (called once from ``main()``)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str, level: str | None = None) -> None:
    lvl = (level or os.environ.get("OVERTURE_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(
        level=lvl,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        force=True,
    )
