"""LoadIntoPool from a remote tier (S3): its layers are read further ahead than local ones
(``load_readahead_remote_layers``): each waits on round trips, which overlap."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.kvstore.engine_path.data_path import EnginePoolPath
from tests.unit.kvstore.engine_path.paths import (
    DST,
    SRC,
    STRIDE,
    _ssd_only,
    load,
    lookup,
    make_store,
)
from tests.unit.kvstore.pools import CHUNK_TOKENS, LAYERS, geometry, hashes, ids


async def test_layers_from_a_remote_tier_are_read_ahead_together(tmp_path: Path,
                                                                 pool) -> None:
    async with make_store(tmp_path) as store, EnginePoolPath(
            store, CHUNK_TOKENS, readahead_layers=1, remote_readahead_layers=3) as path:
        pid, _ = await path.attach(geometry(pool))
        hs = hashes(32)
        saved = await _ssd_only(path, pid, pool, hs, seed=3)
        lower = store.tiers[1]
        lower.remote = True  # (the SSD tier standing in for S3)
        reads = lower.get_many_checked
        in_flight, most, three = 0, 0, asyncio.Event()

        async def counted(keys, check):  # type: ignore[no-untyped-def]
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            if in_flight == 3:
                three.set()
            try:
                # A layer's read waits (bounded) for two more to be under way with it.
                await asyncio.wait_for(three.wait(), 5.0)
            except TimeoutError:
                pass
            try:
                return await reads(keys, check)
            finally:
                in_flight -= 1

        lower.get_many_checked = counted  # type: ignore[method-assign]
        r = await lookup(path, hs)
        assert r.matched_blocks == 32
        msgs = await load(path, pid, r, ids(0, 32, DST, STRIDE))
        assert [m.ok for m in msgs] == [True] * LAYERS
        assert most == 3  # three layers' reads at once (1 with the local readahead)
        for layer in range(LAYERS):
            got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(32)]]
            assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(32)]])
        lower.remote = False
        await store.writer.wait_idle(10.0)
