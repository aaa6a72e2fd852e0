from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.device_memory import DeviceMemory
from shared.config import ConfigError

from .conftest import make_pool


def test_reserved_not_committed_until_grown(kv_pool: DeviceMemory) -> None:
    assert kv_pool.kv_cache.shape == (8, 2, 4, 1, 32)  # (blocks, K/V, tokens, heads, dim)
    assert kv_pool.num_committed_blocks == 0
    assert kv_pool.resident_bytes() == 0  # sparse shm file
    assert kv_pool.grow() == 0
    assert kv_pool.resident_bytes() >= kv_pool.page_span
    assert kv_pool.grow() == 1
    assert kv_pool.grow() is None  # budget used up
    assert kv_pool.num_committed_blocks == 8


def test_release_punches_the_page_out_of_the_shm_file(kv_pool: DeviceMemory) -> None:
    kv_pool.grow()
    kv_pool.grow()
    kv_pool.kv_cache[4:8].fill_(3.0)  # page 1
    before = kv_pool.resident_bytes()
    kv_pool.release(1)
    assert kv_pool.resident_bytes() == before - kv_pool.page_span
    assert kv_pool.grow() == 1
    assert torch.count_nonzero(kv_pool.kv_cache[4:8]) == 0  # memory really went away


def test_another_mapping_of_the_name_sees_the_same_bytes(kv_pool: DeviceMemory) -> None:
    kv_pool.grow()
    nbytes = kv_pool.num_pages * kv_pool.page_span
    other = torch.empty(0, dtype=torch.uint8).set_(
        torch.UntypedStorage.from_file(kv_pool.name, shared=True, nbytes=nbytes)
    )
    view = other.view(torch.float32).view(kv_pool.kv_cache.shape)
    kv_pool.kv_cache[2, 1, 3, 0, 5] = 42.0
    assert view[2, 1, 3, 0, 5].item() == 42.0


def test_close_removes_the_shm_file() -> None:
    pool = make_pool(num_pages=1)
    path = Path(pool.name)
    assert path.exists()
    pool.close()
    assert not path.exists()


def test_budget_below_one_page_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="engine.device_memory_bytes"):
        DeviceMemory(
            block_size=4,
            num_kv_heads=1,
            head_dim=32,
            dtype=torch.float32,
            budget_bytes=2048,
            page_bytes=4096,
        )


def test_block_pool_grows_on_demand_and_shrink_releases_memory(kv_pool: DeviceMemory) -> None:
    pool = BlockAllocator(kv_pool)
    a = pool.allocate(6)
    assert a == [0, 1, 2, 3, 4, 5] and kv_pool.num_committed_pages == 2
    pool.check_integrity()
    resident = kv_pool.resident_bytes()
    pool.free(a[4:])  # page 1 (blocks 4..7) now holds nothing
    assert pool.shrink(2) == 1  # page 0 is still in use
    pool.check_integrity()
    assert kv_pool.num_committed_pages == 1 and pool.num_free == 0
    assert kv_pool.resident_bytes() == resident - kv_pool.page_span
    assert pool.allocate(2) == [4, 5]  # committed again on demand
    pool.check_integrity()


def test_a_live_pool_file_survives_another_engine_starting(tmp_path: Path) -> None:
    from services.engine.device import SharedMemoryFile

    first = SharedMemoryFile(1 << 20, directory=tmp_path)
    second = SharedMemoryFile(1 << 20, directory=tmp_path)  # (its start-up cleanup ran)
    assert first.path.exists() and second.path.exists()
    assert not list(tmp_path.glob(".overture-kv-creating-*"))
    second.close()
    first.close()
    assert not list(tmp_path.iterdir())


def test_a_pools_reserve_keeps_another_engines_pool_out_of_it(tmp_path: Path) -> None:
    """Two pools on one node ledger: the one with a reserve can always grow to it; the
    other cannot take what it holds back; closing the pool drops the reserve."""
    from shared.device_ledger import DeviceLedger, create_ledger

    page = 4 * 1024  # 4 blocks of 1 KiB
    ledger_path = create_ledger(tmp_path / "ledger", 4 * page)

    def pool(reserve_pages: int) -> tuple[DeviceMemory, DeviceLedger]:
        ledger = DeviceLedger(ledger_path)
        ledger.join()
        return DeviceMemory(block_size=4, num_kv_heads=1, head_dim=32, dtype=torch.float32,
                            budget_bytes=4 * page, page_bytes=page, ledger=ledger,
                            reserve_bytes=reserve_pages * page), ledger

    hot, hot_ledger = pool(0)
    cold, cold_ledger = pool(2)
    assert cold.reserve_pages == 2 and hot.reserve_pages == 0
    assert hot.num_uncommitted_blocks == 2 * 4  # two pages held back for the cold pool
    assert hot.grow() == 0 and hot.grow() == 1 and hot.grow() is None
    assert cold.num_uncommitted_blocks == 2 * 4
    assert cold.grow() == 0 and cold.grow() == 1 and cold.grow() is None  # budget used up
    cold.release(1)
    assert hot.grow() is None  # the freed page is cold's reserve
    assert cold.grow() == 1
    cold.close()
    assert hot.grow() == 2 and hot.grow() == 3  # the reserve went with the pool
    hot.close()
    for ledger in (hot_ledger, cold_ledger):
        ledger.close()
