"""LoadIntoPool from the SSD tier: chunks read straight into their blocks, and every way a
chunk can be wrong failing only its layer."""

from __future__ import annotations

import pytest
import torch

from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LookupRequest
from shared.chunk_codec import ChunkMeta, chunk_key
from tests.unit.kvstore.engine_path.paths import (
    DST,
    SRC,
    STRIDE,
    _into_the_pool,
    _repacked,
    _ssd_only,
    durable,
    load,
    lookup,
    save,
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
from tests.unit.kvstore.tier_faults import overwrite


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


@pytest.mark.parametrize("nowait", [True, False])
async def test_ssd_chunks_are_read_straight_into_their_blocks(
    path: EnginePoolPath, pool, monkeypatch: pytest.MonkeyPatch, nowait: bool
) -> None:
    """SSD chunks go from their files into the target blocks (preadv, no blob, no
    scatter copy, no DRAM promotion), inline when the page cache holds them, else on the
    tier's reading thread; the loaded blocks equal the saved ones."""
    import os
    import threading

    from services.kvstore.engine_path import copy_on_read
    from services.kvstore.engine_path import load as load_mod

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(40)
    saved = await _ssd_only(path, pid, pool, hs, seed=11)
    ssd = path.store.tiers[1]
    ssd._nowait = nowait and ssd._nowait
    scattered: list[str] = []
    reads: list[str] = []
    real_scatter, real_preadv = load_mod.scatter_blocks, os.preadv

    def spy_scatter(*a, **kw):
        scattered.append(threading.current_thread().name)
        return real_scatter(*a, **kw)

    def spy_preadv(*a, **kw):
        reads.append(threading.current_thread().name)
        return real_preadv(*a, **kw)

    monkeypatch.setattr(load_mod, "scatter_blocks", spy_scatter)
    monkeypatch.setattr(copy_on_read, "scatter_blocks", spy_scatter)
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


async def test_ssd_chunks_with_an_unexpected_head_are_parsed_and_checked(
    path: EnginePoolPath, pool
) -> None:
    """The load recognises the chunks its lease named by their head's bytes. A sound chunk
    whose head is laid out differently loads all the same (parsed, then read again), with
    exactly its bytes; one of the same size whose head names another layer (a chunk moved
    under another key) fails its layer, is counted corrupt and deleted."""
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
    assert "missing or corrupt" in msgs[1].error
    got = pool.kv_cache[[DST + i for i in range(40)]]
    assert torch.equal(got, saved[[SRC + i for i in range(40)]])  # layer 0, repacked included
    assert path.store.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
    assert await ssd.contains(k0) and not await ssd.contains(k1)


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
