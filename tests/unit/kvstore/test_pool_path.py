"""The same-node data path against a real shm pool (engine DeviceMemory) and real RocksDB."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.pool.attach import PoolError
from services.kvstore.pool.data_path import EnginePoolPath
from services.kvstore.pool.types import LoadRequest, LookupRequest, SaveRequest
from services.kvstore.store import TieredStore
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import ChunkMeta, chunk_key
from shared.config import ConfigError
from shared.kv_layout import StoredPrefix
from tests.unit.kvstore.pools import (
    CHUNK_TOKENS,
    LAYERS,
    MODEL,
    TENANT,
    fill,
    geometry,
    hashes,
    ids,
    make_pool,
)
from tests.unit.kvstore.tier_faults import overwrite

STRIDE = 64  # pool blocks per layer in the tests' layouts
SRC, DST = 0, 256  # bases of the saved and the loaded blocks


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.close()


def make_store(tmp_path: Path, dram: int = 1 << 24, ssd: bool = True) -> TieredStore:
    tiers = [DramTier(dram)]
    if ssd:
        tiers.append(SsdTier(str(tmp_path / "db"), 1 << 24))
    return TieredStore(tiers, KVStoreMetrics(), retry_backoff_max_s=0.02, drain_s=0.5)


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


async def save(
    dp: EnginePoolPath, pid: str, hs: tuple[bytes, ...], first: int = 0, session: str = "sess"
) -> tuple[int, int]:
    n = len(hs) - first
    r = await dp.save(
        SaveRequest(
            pid,
            TENANT,
            session,
            MODEL,
            hs,
            len(hs) * 16 + 3,
            first,
            tuple(ids(first, n, SRC, STRIDE)),
            LAYERS,
        )
    )
    return r.chunks_written, r.chunks_skipped


async def lookup(
    dp: EnginePoolPath, hs: tuple[bytes, ...], first: int = 0, session: str = "sess"
) -> StoredPrefix:
    return await dp.lookup(LookupRequest(TENANT, session, MODEL, hs, first, LAYERS))


async def load(dp: EnginePoolPath, pid: str, r: StoredPrefix, dst_ids: list[int]) -> list:
    req = LoadRequest(pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(dst_ids), LAYERS)
    return [m async for m in dp.load(req)]


def spans_of(r: StoredPrefix) -> list[tuple[int, int]]:
    return [(s.first_block, s.use_blocks) for s in r.spans]


async def durable(dp: EnginePoolPath) -> None:
    await dp.wait_manifests()
    await dp.store.writer.close(5.0)  # drain the write-behind
    await dp.store.writer.start()


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
    assert (await path.manifests.get_manifest(TENANT, "sess")).block_hashes == hs
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


async def test_corrupt_layer_2_loads_layers_0_1_and_fails_layer_2(
    path: EnginePoolPath, pool
) -> None:
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    fill(pool, ids(0, 40, SRC, STRIDE), seed=5)
    saved = pool.kv_cache.clone()
    await save(path, pid, hs)
    await durable(path)
    for key in path.store.dram._index.keys():
        await path.store.dram.delete(key)
    ssd = path.store.tiers[1]
    key = "c/" + chunk_key(TENANT, MODEL, hs[31], 2)  # layer 2, chunk 1
    blob = bytearray(await ssd.get(key))
    blob[-100] ^= 0xFF
    await overwrite(ssd, key, bytes(blob))
    r = await lookup(path, hs)
    assert r.matched_blocks == 40
    pool.kv_cache[DST:].zero_()
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert [(m.layer, m.ok) for m in msgs] == [(0, True), (1, True), (2, False)]
    assert "corrupt" in msgs[2].error
    for layer in range(2):
        got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(40)]]
        assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(40)]])
    # Layer 2 failed: the engine recomputes it and never indexes its blocks. Its good
    # chunks may have been copied where they were read; the corrupt one was read straight
    # into its blocks before its checksum could be checked, so they hold the file's bytes
    # (the flipped one in the last block). Nothing else is written.
    for i in range(40):
        got = pool.kv_cache[DST + 2 * STRIDE + i]
        want = saved[SRC + 2 * STRIDE + i]
        if i == 31:
            assert not got.any() or (got != want).sum() == 1
        else:
            assert not got.any() or torch.equal(got, want)
    assert path.store.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
    r = await lookup(path, hs)  # the bad copy was deleted: layer 2 of chunk 1 is a miss now
    assert r.matched_blocks == 16
    path.release(r.lease_id)


async def test_lease_keeps_dram_hits_through_eviction(tmp_path: Path, pool) -> None:
    # DRAM only, room for about one session: eviction would lose the data for good.
    async with (
        make_store(tmp_path, dram=330_000, ssd=False) as store,
        EnginePoolPath(store, CHUNK_TOKENS) as dp,
    ):
        pid, _ = await dp.attach(geometry(pool))
        hs = hashes(40)
        fill(pool, ids(0, 40, SRC, STRIDE), seed=6)
        saved = pool.kv_cache.clone()
        await save(dp, pid, hs)
        r = await lookup(dp, hs)
        assert r.matched_blocks == 40
        # A high-priority chunk nearly the size of DRAM evicts every chunk of the session.
        filler = ChunkMeta(TENANT, MODEL, 0, hashes(1, tag="filler"))
        await store.put(filler, torch.zeros(320_000 // 4), priority=10)
        assert not any(
            store.dram.has_local("c/" + chunk_key(TENANT, MODEL, hs[e], layer))
            for e in (15, 31, 39)
            for layer in range(LAYERS)
        )
        msgs = await load(dp, pid, r, ids(0, 40, DST, STRIDE))
        assert all(m.ok for m in msgs)
        for layer in range(LAYERS):
            got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(40)]]
            assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(40)]])
        assert (await lookup(dp, hs)).matched_blocks == 0  # lease gone, data evicted
        store.check_integrity()


async def test_lease_pins_ssd_keys_and_expires(tmp_path: Path, pool) -> None:
    async with (
        make_store(tmp_path) as store,
        EnginePoolPath(store, CHUNK_TOKENS, lease_s=0.05) as dp,
    ):
        pid, _ = await dp.attach(geometry(pool))
        hs = hashes(40)
        fill(pool, ids(0, 40, SRC, STRIDE), seed=7)
        await save(dp, pid, hs)
        await durable(dp)
        for key in store.dram._index.keys():
            await store.dram.delete(key)
        r = await lookup(dp, hs)
        ssd_index = store.tiers[1]._index
        key = "c/" + chunk_key(TENANT, MODEL, hs[15], 1)
        assert r.lease_id and ssd_index.is_pinned(key)
        assert key not in ssd_index.victims(1 << 30)  # eviction skips leased chunks
        await asyncio.sleep(0.2)
        assert len(dp.leases) == 0 and not ssd_index.is_pinned(key)
        assert store.metrics.value("kvstore_leases") == 0
        assert dp.release(r.lease_id) is False  # already expired: harmless


def path_store_empty(store: TieredStore) -> bool:
    return store.stats()[0].entries == 0


async def test_attach_rejects_bad_geometry(tmp_path: Path, pool) -> None:
    import dataclasses
    import os

    from services.kvstore.pool.attach import PoolGeometry

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


async def test_abandoned_load_stops_writing_and_ends_its_lease(path: EnginePoolPath, pool) -> None:
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    fill(pool, ids(0, 40, SRC, STRIDE), seed=8)
    saved = pool.kv_cache.clone()
    await save(path, pid, hs)
    r = await lookup(path, hs)
    pool.kv_cache[DST:].zero_()
    req = LoadRequest(
        pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS
    )
    stream = path.load(req)
    first = await anext(stream)
    assert (first.layer, first.ok) == (0, True)
    await stream.aclose()  # the engine dropped the stream after layer 0
    assert len(path.leases) == 0
    assert not pool.kv_cache[DST + STRIDE : DST + 3 * STRIDE].any()  # layers 1, 2 untouched
    # without a live lease the load still works (chunks re-read and checked by key)
    msgs = [m async for m in path.load(req)]
    assert all(m.ok for m in msgs)
    got = pool.kv_cache[[DST + 2 * STRIDE + i for i in range(40)]]
    assert torch.equal(got, saved[[SRC + 2 * STRIDE + i for i in range(40)]])
    with pytest.raises(PoolError, match="block_ids"):
        [
            m
            async for m in path.load(
                LoadRequest(pid, "", TENANT, MODEL, tuple(r.spans), (1, 2, 3), LAYERS)
            )
        ]
    with pytest.raises(PoolError, match="outside the pool"):
        bad = [pool.num_blocks + 5] * (40 * LAYERS)
        [
            m
            async for m in path.load(
                LoadRequest(pid, "", TENANT, MODEL, tuple(r.spans), tuple(bad), LAYERS)
            )
        ]
    with pytest.raises(PoolError, match="repeat"):
        twice = ids(0, 40, DST, STRIDE)
        twice[1] = twice[0]
        [
            m
            async for m in path.load(
                LoadRequest(pid, "", TENANT, MODEL, tuple(r.spans), tuple(twice), LAYERS)
            )
        ]


def _into_the_pool(offset: int, bufs: list) -> bool:
    """Whether a ``FileStored.readinto`` reads a payload into pool blocks: a chunk the lease
    named is read whole, its head into one buffer and the payload into the blocks after;
    another has its payload read from past its head. (One buffer from 0: a head or a
    whole blob.)"""
    return offset > 0 or len(bufs) > 1


async def _ssd_only(path: EnginePoolPath, pid: str, pool, hs: tuple[bytes, ...], seed: int):
    """Save ``hs`` from the SRC blocks, wait until durable, drop every DRAM copy."""
    fill(pool, ids(0, len(hs), SRC, STRIDE), seed=seed)
    saved = pool.kv_cache.clone()
    await save(path, pid, hs)
    await durable(path)
    for key in path.store.dram._index.keys():
        await path.store.dram.delete(key)
    pool.kv_cache[DST:].zero_()
    return saved


@pytest.mark.parametrize("nowait", [True, False])
async def test_ssd_chunks_are_read_straight_into_their_blocks(
    path: EnginePoolPath, pool, monkeypatch: pytest.MonkeyPatch, nowait: bool
) -> None:
    """SSD chunks go from their files into the target blocks (preadv, no blob, no
    scatter copy, no DRAM promotion), inline when the page cache holds them, else on the
    tier's reading thread; the loaded blocks equal the saved ones."""
    import os
    import threading

    from services.kvstore.pool import load as pool_load

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    saved = await _ssd_only(path, pid, pool, hs, seed=11)
    ssd = path.store.tiers[1]
    ssd._nowait = nowait and ssd._nowait
    scattered: list[str] = []
    reads: list[str] = []
    real_scatter, real_preadv = pool_load.scatter_blocks, os.preadv

    def spy_scatter(*a, **kw):
        scattered.append(threading.current_thread().name)
        return real_scatter(*a, **kw)

    def spy_preadv(*a, **kw):
        reads.append(threading.current_thread().name)
        return real_preadv(*a, **kw)

    monkeypatch.setattr(pool_load, "scatter_blocks", spy_scatter)
    monkeypatch.setattr(os, "preadv", spy_preadv)
    r = await lookup(path, hs)
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert all(m.ok for m in msgs)
    assert not scattered
    # per chunk one read, head and payload at once: the lease named the chunk, so its
    # head is compared with the expected bytes instead of read and parsed first
    assert len(reads) == 3 * LAYERS
    on_loop = threading.current_thread().name
    assert all((t == on_loop) == ssd._nowait for t in reads)
    assert all(not t.startswith("kv-ssd") for t in reads) == ssd._nowait
    assert path.store.dram.stats().entries == 0
    for layer in range(LAYERS):
        got = pool.kv_cache[[DST + layer * STRIDE + i for i in range(40)]]
        assert torch.equal(got, saved[[SRC + layer * STRIDE + i for i in range(40)]])


async def test_a_sound_but_mismatching_ssd_chunk_fails_its_layer_and_is_kept(
    path: EnginePoolPath, pool
) -> None:
    """A chunk with a valid checksum that does not fit the request (another shape) is not
    copied and fails the layer; it is not corruption: no checksum failure, the copy stays."""
    from shared.chunk_codec import encode_chunk

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=12)
    ssd = path.store.tiers[1]
    key = chunk_key(TENANT, MODEL, hs[15], 1)  # layer 1, chunk 0
    wrong = torch.ones(16, 2, CHUNK_TOKENS // 16, 1, 8)
    await overwrite(
        ssd, "c/" + key, bytes(encode_chunk(ChunkMeta(TENANT, MODEL, 1, hs[:16]), wrong))
    )
    r = await lookup(path, hs)
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert [(m.layer, m.ok) for m in msgs] == [(0, True), (1, False)]
    assert "the pool wants" in msgs[1].error
    assert not pool.kv_cache[[DST + STRIDE + i for i in range(16)]].any()
    assert path.store.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 0
    assert await ssd.contains("c/" + key)


def _repacked(blob: bytes, **fields) -> bytes:
    """``blob`` with its header map packed in another key order (as another encoder may
    write it) and ``fields`` replaced; sealed, payload unchanged."""
    import msgpack

    from shared.chunk_codec import _PREAMBLE, PREAMBLE_BYTES, parse_head, seal_chunk

    head = parse_head(blob, len(blob))
    hlen = _PREAMBLE.unpack_from(blob)[3]
    h = msgpack.unpackb(blob[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen])
    h.update(fields)
    header = msgpack.packb(dict(sorted(h.items())))
    out = bytearray(_PREAMBLE.pack(b"OVKC", 2, 0, len(header), 0)) + header
    out += bytes(-len(out) % 64) + blob[head.payload_offset :]
    seal_chunk(out)
    return bytes(out)


async def test_ssd_chunks_with_an_unexpected_head_are_parsed_and_checked(
    path: EnginePoolPath, pool
) -> None:
    """The load recognises the chunks its lease named by their head's bytes. A sound chunk
    whose head is laid out differently loads all the same (parsed, then read again), with
    exactly its bytes; one of the same size whose head names another layer fails its
    layer, is not counted corrupt and is kept."""
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    saved = await _ssd_only(path, pid, pool, hs, seed=15)
    ssd = path.store.tiers[1]
    k0 = "c/" + chunk_key(TENANT, MODEL, hs[15], 0)  # layer 0, chunk 0
    await overwrite(ssd, k0, _repacked(await ssd.get(k0)))
    k1 = "c/" + chunk_key(TENANT, MODEL, hs[31], 1)  # layer 1, chunk 1: layer 2's header
    await overwrite(ssd, k1, _repacked(await ssd.get(k1), layer=2))
    r = await lookup(path, hs)
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert [(m.layer, m.ok) for m in msgs] == [(0, True), (1, False)]
    assert "another tenant/model/layer" in msgs[1].error
    got = pool.kv_cache[[DST + i for i in range(40)]]
    assert torch.equal(got, saved[[SRC + i for i in range(40)]])  # layer 0, repacked included
    assert path.store.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 0
    assert await ssd.contains(k0) and await ssd.contains(k1)


@pytest.mark.parametrize("nowait", [True, False])
async def test_a_lease_naming_impossible_hashes_fails_the_layer_cleanly(
    path: EnginePoolPath, pool, nowait: bool
) -> None:
    """A lookup prompt with an empty hash inside a stored chunk (its last hash matches)
    leases that chunk with hashes no chunk can have: the load fails the layer with the
    reason, as for any hash mismatch, without a tier error on either read path."""
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=16)
    ssd = path.store.tiers[1]
    ssd._nowait = nowait and ssd._nowait
    odd = (*hs[:3], b"", *hs[4:])
    r = await path.lookup(LookupRequest(TENANT, "", MODEL, odd, 0, LAYERS))
    assert r.lease_id and r.matched_blocks == 40
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert [(m.layer, m.ok) for m in msgs] == [(0, False)]
    assert "differ from the lookup's" in msgs[0].error
    assert path.store.metrics.value("kvstore_tier_errors_total", tier="ssd", op="get") == 0


async def test_abandoned_ssd_load_writes_nothing_after_it_ends(path: EnginePoolPath, pool) -> None:
    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=13)
    r = await lookup(path, hs)
    req = LoadRequest(
        pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS
    )
    stream = path.load(req)
    first = await anext(stream)
    assert (first.layer, first.ok) == (0, True)
    await stream.aclose()  # a read-and-copy of the next layer may be under way: waited for
    after = pool.kv_cache.clone()
    await asyncio.sleep(0.1)
    assert torch.equal(pool.kv_cache, after)
    assert not pool.kv_cache[DST + 2 * STRIDE : DST + 3 * STRIDE].any()  # never started


async def test_blocks_written_during_an_ssd_read_fail_the_layer_not_the_chunk(
    path: EnginePoolPath, pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the pool's copy of a chunk read straight into its blocks fails the checksum
    while the file's own bytes are sound (something wrote the blocks meanwhile), the
    layer is recomputed and the chunk is neither counted corrupt nor deleted."""
    from services.kvstore.tiers.ssd import FileStored

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=13)
    ssd = path.store.tiers[1]
    keys_before = sorted(ssd.keys())
    real = FileStored.readinto

    def scribbled(self, offset, bufs):
        real(self, offset, bufs)
        if _into_the_pool(offset, bufs):
            bufs[-1][:4] = b"\xff\xff\xff\xff"  # as a concurrent writer would

    monkeypatch.setattr(FileStored, "readinto", scribbled)
    r = await lookup(path, hs)
    msgs = await load(path, pid, r, ids(0, 40, DST, STRIDE))
    assert [(m.layer, m.ok) for m in msgs] == [(0, False)]
    assert "changed while" in msgs[0].error
    assert path.store.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 0
    assert sorted(ssd.keys()) == keys_before


async def test_fence_waits_for_a_dropped_load_still_copying(
    path: EnginePoolPath, pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine gave up on a load (deadline) while a read into its blocks was under way:
    FencePoolOp returns only once that read is over, never while it can still write."""
    import dataclasses
    import threading

    from services.kvstore.tiers.ssd import FileStored

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=14)
    path.store.tiers[1]._nowait = False  # reads on the tier's threads, where we can hold one
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []
    real = FileStored.readinto

    def held(self, offset, bufs):
        if _into_the_pool(offset, bufs) and not entered.is_set():  # the first such read
            entered.set()
            release.wait(10)
            events.append("read done")
        return real(self, offset, bufs)

    monkeypatch.setattr(FileStored, "readinto", held)
    r = await lookup(path, hs)
    req = dataclasses.replace(
        LoadRequest(
            pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS
        ),
        op_id="op-1",
    )

    async def consume() -> None:
        async for _ in path.load(req):
            pass

    loader = asyncio.create_task(consume())
    await asyncio.to_thread(entered.wait, 10)
    loader.cancel()  # the call is dropped: the read under way still runs to its end

    async def fence() -> None:
        await path.fence("op-1")
        events.append("fenced")

    fencer = asyncio.create_task(fence())
    await asyncio.sleep(0.1)
    assert not fencer.done() and path.ops.running == 1
    release.set()
    await asyncio.wait_for(fencer, 10)
    await asyncio.gather(loader, return_exceptions=True)
    assert events == ["read done", "fenced"]
    assert path.ops.running == 0


async def test_a_fenced_op_that_arrives_late_is_refused(path: EnginePoolPath, pool) -> None:
    """A fence for a call the kvstore has not seen (still in transit) retires its id:
    if the call turns up afterwards it is refused before it touches the pool."""
    import dataclasses

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=15)
    await path.fence("late-1")  # returns at once
    r = await lookup(path, hs)
    req = dataclasses.replace(
        LoadRequest(
            pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS
        ),
        op_id="late-1",
    )
    with pytest.raises(PoolError, match="fenced"):
        [m async for m in path.load(req)]
    assert not pool.kv_cache[DST:].any()
    # The refused load's lease ends with it: nothing is left pinned until it would expire.
    assert len(path.leases) == 0
    assert not any(path.store.tiers[1]._index.is_pinned(k) for k in path.store.tiers[1].keys())
    with pytest.raises(PoolError, match="fenced"):
        await path.save(
            dataclasses.replace(
                SaveRequest(
                    pid,
                    TENANT,
                    "s",
                    MODEL,
                    hs,
                    len(hs) * 16,
                    0,
                    tuple(ids(0, 40, SRC, STRIDE)),
                    LAYERS,
                ),
                op_id="late-1",
            )
        )


async def test_a_lease_does_not_expire_while_a_load_uses_it(tmp_path: Path, pool) -> None:
    """A slow load keeps its chunks pinned to the end, however long its lease_s was."""
    import dataclasses

    from services.kvstore.pool.leases import HELD_FACTOR

    async with (
        make_store(tmp_path) as store,
        EnginePoolPath(store, CHUNK_TOKENS, lease_s=0.1) as dp,
    ):
        pid, _ = await dp.attach(geometry(pool))
        hs = hashes(40)
        await _ssd_only(dp, pid, pool, hs, seed=17)
        r = await lookup(dp, hs)
        ssd = store.tiers[1]
        last = "c/" + chunk_key(TENANT, MODEL, hs[39], LAYERS - 1)
        req = LoadRequest(
            pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS
        )
        stream = dp.load(req)
        first = await anext(stream)  # the load holds the lease from here
        assert first.ok
        await asyncio.sleep(0.3)  # three lease_s: a timed lease would have ended
        assert len(dp.leases) == 1 and ssd._index.is_pinned(last)
        assert all(m.ok for m in [m async for m in stream])
        assert len(dp.leases) == 0 and not ssd._index.is_pinned(last)
        dp.check_integrity()
        # A load stuck for good (its client stopped reading) pins its chunks only until
        # HELD_FACTOR x lease_s.
        r = await lookup(dp, hs)
        stream = dp.load(dataclasses.replace(req, lease_id=r.lease_id))
        assert (await anext(stream)).ok
        await asyncio.sleep(0.1 * HELD_FACTOR + 0.3)
        assert len(dp.leases) == 0 and not ssd._index.is_pinned(last)
        await stream.aclose()


async def test_fence_waits_for_a_dropped_save_still_reading(
    path: EnginePoolPath, pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose call was dropped keeps reading the pool on its thread: its op ends,
    and its fence returns, only after that read."""
    import dataclasses
    import threading

    from services.kvstore.pool import save as pool_path_mod

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(20)
    fill(pool, ids(0, 20, SRC, STRIDE), seed=16)
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []
    real = pool_path_mod.encode_from_pool

    def held(kv, jobs):
        entered.set()
        release.wait(10)
        events.append("read done")
        return real(kv, jobs)

    monkeypatch.setattr(pool_path_mod, "encode_from_pool", held)
    req = dataclasses.replace(
        SaveRequest(
            pid, TENANT, "s", MODEL, hs, len(hs) * 16, 0, tuple(ids(0, 20, SRC, STRIDE)), LAYERS
        ),
        op_id="save-1",
    )
    saver = asyncio.create_task(path.save(req))
    await asyncio.to_thread(entered.wait, 10)
    saver.cancel()

    async def fence() -> None:
        await path.fence("save-1")
        events.append("fenced")

    fencer = asyncio.create_task(fence())
    await asyncio.sleep(0.1)
    assert not fencer.done()
    release.set()
    await asyncio.wait_for(fencer, 10)
    await asyncio.gather(saver, return_exceptions=True)
    assert events == ["read done", "fenced"]


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
        forgetting = asyncio.create_task(dp.forget(TENANT, "gone"))
        await asyncio.sleep(0.05)
        assert forgetting.done() == (phase == "waiting")  # a write under way is waited for
        remote.gate.set()
        await asyncio.wait_for(forgetting, 5)
        await dp.manifests.delete_manifest(TENANT, "gone", [])
        await dp.wait_manifests()
        await asyncio.sleep(0.05)
        assert await dp.manifests.get_manifest(TENANT, "gone") is None


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


async def test_a_lease_whose_lookup_reply_never_reached_the_caller_ends(
    path: EnginePoolPath, pool
) -> None:
    """A LookupPrefix cancelled after its lease was granted (the caller's deadline, a
    disconnect) ends that lease: its id was never received, so no one else would."""
    from services.kvstore.service import KVStoreService
    from shared.proto import kvstore_pb2 as pb

    class Context:
        def __init__(self, cancelled: bool) -> None:
            self._cancelled, self.callbacks = cancelled, []

        def add_done_callback(self, cb) -> None:
            self.callbacks.append(cb)

        def cancelled(self) -> bool:
            return self._cancelled

        def time_remaining(self) -> float | None:
            return None  # no deadline

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=21)
    svc = KVStoreService(path.manifests, "n", 4, "", path)
    req = pb.LookupPrefixRequest(
        tenant=TENANT,
        session_id="sess",
        model_fp=MODEL,
        block_hashes=list(hs),
        first_block=0,
        num_layers=LAYERS,
    )
    for cancelled in (True, False):
        ctx = Context(cancelled)
        reply = await svc.LookupPrefix(req, ctx)
        assert reply.lease_id and len(path.leases) == 1
        for cb in ctx.callbacks:  # the RPC ends
            cb(ctx)
        assert len(path.leases) == (0 if cancelled else 1)
    path.release(reply.lease_id)


@pytest.mark.parametrize("deadline_s", [0.1, 5.0])
async def test_a_lookup_past_its_deadline_ends_its_lease(
    path: EnginePoolPath, pool, deadline_s: float
) -> None:
    """Real gRPC: a reply that leaves after the caller's deadline never arrives, and the
    server sees no cancellation, only time run out: its lease ends all the same."""
    import time

    import grpc

    from services.kvstore.service import KVStoreService
    from shared.grpc_server import insecure_channel, serve_grpc
    from shared.proto import kvstore_pb2 as pb
    from shared.proto import kvstore_pb2_grpc as pb_grpc

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    await _ssd_only(path, pid, pool, hs, seed=22)
    real = path.lookup

    async def slow(req):
        out = await real(req)
        time.sleep(0.3)  # the loop is held: the reply leaves 0.3 s after the grant
        return out

    path.lookup = slow
    svc = KVStoreService(path.manifests, "n", 4, "", path)
    register = [lambda s: pb_grpc.add_KVStoreServicer_to_server(svc, s)]
    async with (
        serve_grpc("127.0.0.1", 0, register=register, service_names=[]) as srv,
        insecure_channel(f"127.0.0.1:{srv.port}") as channel,
    ):
        req = pb.LookupPrefixRequest(
            tenant=TENANT,
            session_id="sess",
            model_fp=MODEL,
            block_hashes=list(hs),
            num_layers=LAYERS,
        )
        try:
            reply = await pb_grpc.KVStoreStub(channel).LookupPrefix(req, timeout=deadline_s)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline_s < 0.3
            reply = None
        await asyncio.sleep(0.3)
        if reply is None:
            assert len(path.leases) == 0
        else:
            assert len(path.leases) == 1
            path.release(reply.lease_id)
