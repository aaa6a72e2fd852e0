"""Prefix leases: what a lookup found stays loadable until loaded, released or expired, and a
lease nobody can use ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LoadRequest
from shared.chunk_codec import ChunkMeta, chunk_key
from tests.unit.kvstore.engine_path.paths import (
    DST,
    SRC,
    STRIDE,
    _ssd_only,
    durable,
    load,
    lookup,
    make_store,
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


async def test_a_lease_does_not_expire_while_a_load_uses_it(tmp_path: Path, pool) -> None:
    """A slow load keeps its chunks pinned to the end, however long its lease_s was."""
    import dataclasses

    from services.kvstore.engine_path.leases import HELD_FACTOR

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
