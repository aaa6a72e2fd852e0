"""``python -m services.kvstore``: start one node's kvstore."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.kvstore.config import KVStoreConfig
from services.kvstore.errors import TierOpenError
from services.kvstore.malloc_tuning import tune_malloc
from services.kvstore.server import run
from shared.service_main import service_main


def main(argv: Sequence[str] | None = None) -> int:
    tune_malloc()
    return service_main(
        KVStoreConfig, "kvstore", argv, "Overture kvstore: DRAM, RocksDB and S3 tiers", run,
        fatal=(TierOpenError,),
    )


if __name__ == "__main__":
    sys.exit(main())
