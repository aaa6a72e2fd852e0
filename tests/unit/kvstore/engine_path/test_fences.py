"""Dropped calls: a load or save the engine gave up on writes nothing after it ends, and
FencePoolOp says when."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.kvstore.engine_path.attach import PoolError
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LoadRequest, SaveRequest
from tests.unit.kvstore.engine_path.paths import (
    DST,
    SRC,
    STRIDE,
    _into_the_pool,
    _ssd_only,
    lookup,
    save,
)
from tests.unit.kvstore.pools import (
    LAYERS,
    MODEL,
    TENANT,
    fill,
    geometry,
    hashes,
    ids,
)


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


async def test_fence_waits_for_a_dropped_save_still_reading(
    path: EnginePoolPath, pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose call was dropped keeps reading the pool on its thread: its op ends,
    and its fence returns, only after that read."""
    import dataclasses
    import threading

    from services.kvstore.engine_path import save as save_mod

    pid, _ = await path.attach(geometry(pool))
    hs = hashes(20)
    fill(pool, ids(0, 20, SRC, STRIDE), seed=16)
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []
    real = save_mod.encode_from_pool

    def held(kv, jobs):
        entered.set()
        release.wait(10)
        events.append("read done")
        return real(kv, jobs)

    monkeypatch.setattr(save_mod, "encode_from_pool", held)
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
