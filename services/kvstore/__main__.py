"""``python -m services.kvstore``: start one node's kvstore."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from services.kvstore.config import KVStoreConfig
from services.kvstore.errors import TierOpenError
from services.kvstore.server import run
from shared.aio import run_main
from shared.config import ConfigError, parse_service_args
from shared.logs import setup_logging

log = logging.getLogger("services.kvstore")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_service_args(
        KVStoreConfig, "kvstore", argv, "Overture kvstore: DRAM, RocksDB and S3 tiers"
    )
    setup_logging("kvstore")
    try:
        run_main(run(config))
    except (ConfigError, TierOpenError) as e:
        # A start-up failure is a configuration problem: one clear line, non-zero exit.
        log.error("kvstore cannot start: %s", e)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
