"""Save, look up and load through a real shm pool and real RocksDB: round trips, growth, edited
histories, attach checks, session deletes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.kvstore.engine_path.attach import PoolError
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LookupRequest, SaveRequest
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store import TieredStore
from services.kvstore.tiers import DramTier
from shared.config import ConfigError
from tests.unit.kvstore.engine_path.paths import (
    DST,
    SRC,
    STRIDE,
    durable,
    load,
    lookup,
    make_store,
    path_store_empty,
    save,
    spans_of,
)
from tests.unit.kvstore.pools import (
    CHUNK_TOKENS,
    LAYERS,
    MODEL,
    TENANT,
    fill,
    geometry,
    hashes,
    ids,
)


async def test_save_clear_lookup_load_roundtrip(path: EnginePoolPath, pool) -> None:
    pid, bpc = await path.attach(geometry(pool))
    assert bpc == 16 and (await path.attach(geometry(pool)))[0] == pid  # re-attach: same id
    hs = hashes(40)
    fill(pool, ids(0, 40, SRC, STRIDE), seed=1)
    saved = pool.kv_cache.clone()
    assert await save(path, pid, hs) == (3 * LAYERS, 0)
    pool.kv_cache.zero_()
    r = await lookup(path, hs)
    assert r.matched_blocks == 40 and spans_of(r) == [(0, 16), (16, 16), (32, 8)]
    assert [s.tier for s in r.spans] == ["dram"] * 3
    assert r.spans[2].nbytes == 8 * pool.block_bytes * LAYERS and r.lease_id
    assert set(r.tier_bytes_per_s) == {"dram", "ssd"}
    dst = ids(0, 40, DST, STRIDE)
    msgs = await load(path, pid, r, dst)
    assert [(m.layer, m.ok) for m in msgs] == [(0, True), (1, True), (2, True)]
    for layer in range(LAYERS):
        src_l = ids(0, 40, SRC + layer * STRIDE, 0, layers=1)
        dst_l = ids(0, 40, DST + layer * STRIDE, 0, layers=1)
        assert torch.equal(pool.kv_cache[dst_l], saved[src_l])  # exact bytes, per layer
    untouched = torch.ones(pool.num_blocks, dtype=torch.bool)
    untouched[dst] = False
    assert not pool.kv_cache[untouched].any()  # nothing written outside the listed blocks
    assert len(path.leases) == 0  # the load consumed its lease
    m = path.store.metrics
    assert m.value("kvstore_pool_bytes_saved_total") == 40 * LAYERS * pool.block_bytes
    assert m.value("kvstore_pool_bytes_loaded_total", tier="dram") == 40 * LAYERS * pool.block_bytes
    assert m.value("kvstore_lookup_blocks_total", result="hit") == 40
    # saving the same sequence again writes nothing new
    assert await save(path, pid, hs) == (0, 3 * LAYERS)


async def test_partial_chunk_growth_and_mid_chunk_first_block(path: EnginePoolPath, pool) -> None:
    pid, _ = await path.attach(geometry(pool))
    h50 = hashes(50)
    fill(pool, ids(0, 50, SRC, STRIDE), seed=2)
    saved = pool.kv_cache.clone()
    await save(path, pid, h50[:40])
    r = await lookup(path, h50)  # turn 2: 50-block prompt, 40 stored (chunk 2 partial)
    assert r.matched_blocks == 40 and spans_of(r) == [(0, 16), (16, 16), (32, 8)]
    path.release(r.lease_id)
    # first_block mid-chunk: the first span starts there and uses only the rest
    r = await lookup(path, h50, first=20)
    assert r.matched_blocks == 40 and spans_of(r) == [(20, 12), (32, 8)]
    pool.kv_cache[DST:].zero_()
    msgs = await load(path, pid, r, ids(0, 20, DST, STRIDE))
    assert all(m.ok for m in msgs)
    for layer in range(LAYERS):
        got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(20)]]
        assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(20, 40)]])
    # end of turn 2: save from the chunk boundary 32 on; now all 50 are found
    assert await save(path, pid, h50, first=32) == (2 * LAYERS, 0)
    r = await lookup(path, h50)
    assert r.matched_blocks == 50 and spans_of(r) == [(0, 16), (16, 16), (32, 16), (48, 2)]
    path.release(r.lease_id)
    with pytest.raises(PoolError, match="multiple of blocks_per_chunk"):
        await save(path, pid, h50, first=40)


async def test_edited_history_stops_at_the_first_differing_block(
    path: EnginePoolPath, pool
) -> None:
    pid, _ = await path.attach(geometry(pool))
    fill(pool, ids(0, 40, SRC, STRIDE), seed=3)
    await save(path, pid, hashes(40))
    edited = hashes(40, diverge_at=20)
    r = await lookup(path, edited)
    assert r.matched_blocks == 20 and spans_of(r) == [(0, 16), (16, 4)]
    path.release(r.lease_id)
    r = await lookup(path, edited, session="")  # no session: whole chunks only
    assert r.matched_blocks == 16
    path.release(r.lease_id)
    r = await lookup(path, hashes(40, tag="other"))
    assert r.matched_blocks == 0 and r.spans == [] and r.lease_id == ""


async def test_lookup_and_load_from_ssd_after_dram_is_dropped(path: EnginePoolPath, pool) -> None:
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    fill(pool, ids(0, 40, SRC, STRIDE), seed=4)
    saved = pool.kv_cache.clone()
    await save(path, pid, hs)
    await durable(path)
    m = await path.manifests.get_manifest(TENANT, scoped_session("sess", MODEL))
    assert m is not None and m.block_hashes == hs
    for key in path.store.dram._index.keys():
        await path.store.dram.delete(key)
    r = await lookup(path, hs)
    assert r.matched_blocks == 40 and [s.tier for s in r.spans] == ["ssd"] * 3
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert all(m.ok for m in msgs)
    for layer in range(LAYERS):
        got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(40)]]
        assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(40)]])
    assert "ssd" in path.bandwidth.measured


async def test_attach_rejects_bad_geometry(tmp_path: Path, pool) -> None:
    import dataclasses
    import os

    from services.kvstore.engine_path.attach import PoolGeometry

    async with make_store(tmp_path, ssd=False) as store, EnginePoolPath(store, 200) as dp:
        with pytest.raises(ConfigError, match="kvstore.chunk_tokens"):
            await dp.attach(geometry(pool))
    async with make_store(tmp_path, ssd=False) as store, EnginePoolPath(store, 256) as dp:
        with pytest.raises(PoolError, match="needs"):
            await dp.attach(
                geometry(pool).__class__(
                    **{**geometry(pool).__dict__, "num_blocks": pool.num_blocks * 2}
                )
            )

        def named(name: str) -> PoolGeometry:
            return dataclasses.replace(geometry(pool), pool_name=name)

        # Only engine pool files are mapped: a pool is read and written by saves and loads.
        victim = tmp_path / "victim.bin"
        victim.write_bytes(bytes(pool.num_blocks * geometry(pool).block_bytes))
        with pytest.raises(PoolError, match="not an engine pool"):
            await dp.attach(named(str(victim)))
        shm = os.path.dirname(pool.name)
        link = os.path.join(shm, f"overture-kv-test-link-{os.getpid()}")
        os.symlink(victim, link)
        try:
            with pytest.raises(PoolError, match="cannot open"):  # O_NOFOLLOW
                await dp.attach(named(link))
        finally:
            os.unlink(link)
        sneaky = f"{shm}/somedir/../overture-kv-x"  # the kernel resolves somedir first
        with pytest.raises(PoolError, match="not an engine pool"):
            await dp.attach(named(sneaky))
        with pytest.raises(PoolError, match="cannot open"):
            await dp.attach(named(os.path.join(shm, "overture-kv-nope")))
        with pytest.raises(PoolError, match="cannot open"):
            await dp.attach(named(os.path.join(shm, "overture-kv-\0")))
        with pytest.raises(PoolError, match="unknown pool_id"):
            await save(dp, "pool-x", hashes(16))
        with pytest.raises(PoolError, match="no pool attached"):
            await lookup(dp, hashes(16))
        for bad in ({"model_fp": ""}, {"model_fp": "a/b"}, {"num_layers": 2**32 - 1}):
            with pytest.raises(PoolError, match="model_fp|num_layers"):
                await dp.attach(dataclasses.replace(geometry(pool), **bad))
        pid, _ = await dp.attach(geometry(pool))
        hs = hashes(16)
        # Requests must name the pool's model and at most its layers: KV saved under another
        # model's keys would be served to that model.
        for model, layers in ((MODEL + "x", LAYERS), (MODEL, LAYERS + 1), (MODEL, 0)):
            with pytest.raises(PoolError, match="model_fp|num_layers"):
                await dp.save(
                    SaveRequest(
                        pid,
                        TENANT,
                        "s",
                        model,
                        hs,
                        256,
                        0,
                        tuple(ids(0, 16, SRC, STRIDE)) * layers,
                        layers,
                    )
                )
            with pytest.raises(PoolError, match="model_fp|num_layers|no pool"):
                await dp.lookup(LookupRequest(TENANT, "s", model, hs, 0, layers))
        assert path_store_empty(store)


async def test_a_pool_file_recreated_under_its_name_is_mapped_anew(tmp_path: Path, pool) -> None:
    """Another engine's pool that reuses a name is another pool: the old mapping (of a file
    that no longer exists) is dropped, never read or written for the new one."""
    import dataclasses
    import os
    import uuid

    name = os.path.join(os.path.dirname(pool.name), f"overture-kv-test-{uuid.uuid4().hex[:8]}")
    g = dataclasses.replace(geometry(pool), pool_name=name)
    size = g.num_blocks * g.block_bytes
    async with make_store(tmp_path, ssd=False) as store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        try:
            for attempt in range(2):
                with open(name, "wb") as f:
                    f.truncate(size)
                first, _ = await dp.attach(g)
                again, _ = await dp.attach(g)
                assert again == first  # the same file: the same mapping
                if attempt == 0:
                    old = first
                    os.unlink(name)  # the engine exits; another one re-creates the name
            assert first != old
            with pytest.raises(PoolError, match="unknown pool_id"):
                dp.pools.get(old)
            dp.check_integrity()
        finally:
            if os.path.exists(name):
                os.unlink(name)


@pytest.mark.parametrize("phase", ["waiting", "writing"])
async def test_a_session_delete_leaves_no_manifest_behind(tmp_path: Path, pool, phase: str) -> None:
    """Forgetting a session (its Delete) while its manifest is pending, either still
    waiting for its chunks or already being written, returns only when no manifest of it
    can appear any more; the delete that follows leaves none."""
    from tests.unit.kvstore.flaky import FlakyTier

    class Gated(FlakyTier):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.entered = asyncio.Event()
            self.gated_prefix = "c/" if phase == "waiting" else "m/"

        async def put(self, key, blob, priority=0):
            if key.startswith(self.gated_prefix):
                self.entered.set()
                await self.gate.wait()
            return await super().put(key, blob, priority)

    remote = Gated()
    store = TieredStore(
        [DramTier(1 << 24), remote], KVStoreMetrics(), retry_backoff_max_s=0.02, drain_s=0.5
    )
    async with store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        hs = hashes(20)
        fill(pool, ids(0, 20, SRC, STRIDE), seed=17)
        await save(dp, pid, hs, session="gone")
        await asyncio.wait_for(remote.entered.wait(), 5)
        forgetting = asyncio.create_task(dp.forget(TENANT, scoped_session("gone", MODEL)))
        await asyncio.sleep(0.05)
        assert forgetting.done() == (phase == "waiting")  # a write under way is waited for
        remote.gate.set()
        await asyncio.wait_for(forgetting, 5)
        await dp.manifests.delete_manifest(TENANT, scoped_session("gone", MODEL), [])
        await dp.wait_manifests()
        await asyncio.sleep(0.05)
        assert await dp.manifests.get_manifest(TENANT, scoped_session("gone", MODEL)) is None
