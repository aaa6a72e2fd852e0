"""Tiny KV pools for allocator and scheduler tests (real shared memory, tiny shapes), and
the tiny demo model (float32) for the AsyncEngine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.device_memory import DeviceMemory
from services.engine.model import LoadedModel, load_model, write_demo_model

# block_bytes = 2 * 4 tokens * 1 head * 32 dims * 4 bytes = 1 KiB; 4 blocks per 4 KiB page.
BLOCK_SIZE = 4


def make_pool(num_pages: int, blocks_per_page: int = 4) -> DeviceMemory:
    return DeviceMemory(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.float32,
        budget_bytes=num_pages * blocks_per_page * 1024,
        page_bytes=blocks_per_page * 1024,
    )


@pytest.fixture
def kv_pool() -> Iterator[DeviceMemory]:
    pool = make_pool(num_pages=2)
    yield pool
    pool.close()


@pytest.fixture
def blocks(kv_pool: DeviceMemory) -> BlockAllocator:
    return BlockAllocator(kv_pool)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_demo_model(tmp_path_factory.mktemp("model") / "tiny", size="tiny", seed=0)
    return load_model(path, dtype=torch.float32)
