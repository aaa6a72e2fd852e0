"""Fixtures of the engine-pool path tests: a real shm pool and a path over real RocksDB."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.kvstore.engine_path.data_path import EnginePoolPath
from tests.unit.kvstore.engine_path.paths import make_store
from tests.unit.kvstore.pools import (
    CHUNK_TOKENS,
    make_pool,
)


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.close()


@pytest.fixture
async def path(tmp_path: Path, pool) -> AsyncIterator[EnginePoolPath]:
    async with make_store(tmp_path) as store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        yield dp
        dp.check_integrity()
        # Writes still under way would finish between the check's reads; let them, and let
        # their acks' callbacks run (a future done a moment ago has its callback pending).
        await store.writer.wait_idle(10.0)
        await asyncio.sleep(0)
        store.check_integrity()
