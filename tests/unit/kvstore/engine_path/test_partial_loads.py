"""LoadIntoPool for a partially resident prefix: target ``-1`` (SKIP) names a block the
engine holds on device already. Skipped blocks are never written; a layer whose spans are
all skipped reads nothing and is reported loaded; a span skipped in part (mid-chunk) is
read once and only its other blocks are written. From DRAM and straight from SSD files."""

from __future__ import annotations

import pytest
import torch

from services.kvstore.engine_path.copies import SKIP, block_runs
from services.kvstore.engine_path.data_path import EnginePoolPath
from tests.unit.kvstore.engine_path.paths import DST, SRC, STRIDE, _ssd_only, load, lookup, save
from tests.unit.kvstore.pools import LAYERS, fill, geometry, hashes, ids


def test_block_runs_keep_skips_apart() -> None:
    assert block_runs([SKIP, SKIP, 1, 2, 5, SKIP]) == [(SKIP, 2), (1, 2), (5, 1), (SKIP, 1)]
    assert block_runs([SKIP, 0]) == [(SKIP, 1), (0, 1)]  # -1 + 1 == 0 is no run
    assert block_runs([7, 8, 9]) == [(7, 3)]


@pytest.mark.parametrize("tier", ["dram", "ssd"])
async def test_skipped_blocks_are_never_written(path: EnginePoolPath, pool, tier: str) -> None:
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)  # chunks of 16 blocks: [0, 16) [16, 32) [32, 40)
    if tier == "ssd":
        saved = await _ssd_only(path, pid, pool, hs, seed=21)
    else:
        fill(pool, ids(0, 40, SRC, STRIDE), seed=21)
        saved = pool.kv_cache.clone()
        await save(path, pid, hs)
        pool.kv_cache[DST:].zero_()
    # Layer 0 of blocks [0, 20) is on device: chunk 0 is skipped whole in layer 0, chunk 1
    # in part (blocks 16..19); every other (layer, block) is loaded.
    target = ids(0, 40, DST, STRIDE)
    for i in range(20):
        target[i] = SKIP
    sentinel = torch.full_like(pool.kv_cache[DST], 7.0)
    for i in range(20):
        pool.kv_cache[DST + i] = sentinel
    r = await lookup(path, hs)
    msgs = await load(path, pid, r, target)
    assert [(m.layer, m.ok) for m in msgs] == [(layer, True) for layer in range(LAYERS)]
    for i in range(20):  # the device's own copies are untouched
        assert torch.equal(pool.kv_cache[DST + i], sentinel)
    got = pool.kv_cache[[DST + i for i in range(20, 40)]]
    assert torch.equal(got, saved[[SRC + i for i in range(20, 40)]])
    for layer in range(1, LAYERS):
        got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(40)]]
        assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(40)]])


async def test_a_layer_skipped_whole_is_reported_loaded_and_not_read(
        path: EnginePoolPath, pool) -> None:
    """(an advisory's prefetch of the lower layers only: the others are SKIP)"""
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    fill(pool, ids(0, 40, SRC, STRIDE), seed=22)
    saved = pool.kv_cache.clone()
    await save(path, pid, hs)
    pool.kv_cache[DST:].zero_()
    target = [b if b < DST + 2 * STRIDE else SKIP for b in ids(0, 40, DST, STRIDE)]
    r = await lookup(path, hs)
    loaded_before = path.store.metrics.value("kvstore_pool_bytes_loaded_total", tier="dram")
    msgs = await load(path, pid, r, target)
    assert [(m.layer, m.ok) for m in msgs] == [(layer, True) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(40)]]
        if layer < 2:
            assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(40)]])
        else:
            assert not got.any()
    loaded = path.store.metrics.value("kvstore_pool_bytes_loaded_total", tier="dram")
    assert loaded - loaded_before == 2 * 40 * pool.block_bytes
