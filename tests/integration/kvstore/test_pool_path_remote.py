"""The pool data path with S3 (a real SeaweedFS server) and through a real kvstore process."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
import torch

from services.kvstore.config import KVStoreConfig
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LoadRequest, LookupRequest, SaveRequest
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.server import build_store
from shared.chunk_codec import chunk_key
from shared.config import build
from shared.proto import kvstore_pb2 as pb
from tests.integration.kvstore.helpers import KVStoreProcess, channel, stub
from tests.integration.kvstore.test_s3_tier import s3cfg
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

STRIDE, SRC, DST = 64, 0, 256


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.close()


def cfg(tmp_path: Path, s3: object, name: str, range_bytes: int = 0) -> KVStoreConfig:
    import dataclasses

    return build(KVStoreConfig, {
        "ssd_path": str(tmp_path / name), "ssd_bytes": 1 << 24, "dram_bytes": 1 << 24,
        "chunk_tokens": CHUNK_TOKENS, "retry_backoff_max_s": 0.05, "drain_s": 2.0,
        "s3": dataclasses.asdict(s3), "s3_range_bytes": range_bytes,
    })


def layer_blocks(base: int, layer: int, first: int, count: int) -> list[int]:
    return [base + layer * STRIDE + i for i in range(first, first + count)]


# 0: one GET per object; 8192: every chunk by ranged GETs in parallel (a chunk of these
# pools is 16 blocks of 2 KiB: its head and the first blocks come with the first range)
@pytest.mark.parametrize("range_bytes", [0, 8192])
async def test_lookup_and_load_from_s3_then_via_manifest_after_restart(
    tmp_path: Path, s3_endpoint: str, pool, range_bytes: int
) -> None:
    s3 = s3cfg(s3_endpoint, f"kv-{uuid.uuid4().hex[:12]}")
    hs = hashes(50)
    fill(pool, ids(0, 40, SRC, STRIDE), seed=11)
    saved = pool.kv_cache.clone()
    config = cfg(tmp_path, s3, "a", range_bytes)
    async with build_store(config, KVStoreMetrics()) as store, \
            EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        await dp.save(SaveRequest(pid, TENANT, "chat", MODEL, hs[:40], 40 * 16, 0,
                                  tuple(ids(0, 40, SRC, STRIDE)), LAYERS))
        await dp.wait_manifests()  # written once every chunk is durable in S3
        m = await dp.manifests.get_manifest(TENANT, scoped_session("chat", MODEL))
        assert m is not None and m.block_hashes == hs[:40]
        for tier in store.tiers[:2]:  # drop DRAM and SSD: only S3 is left
            for key in tier._index.keys():
                await tier.delete(key)
        r = await dp.lookup(LookupRequest(TENANT, "chat", MODEL, hs[:40], 0, LAYERS))
        assert r.matched_blocks == 40 and [s.tier for s in r.spans] == ["s3"] * 3
        msgs = [m async for m in dp.load(LoadRequest(
            pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS,
        ))]
        assert [m.ok for m in msgs] == [True] * LAYERS
        for layer in range(LAYERS):
            assert torch.equal(pool.kv_cache[layer_blocks(DST, layer, 0, 40)],
                               saved[layer_blocks(SRC, layer, 0, 40)])
        assert "s3" in dp.bandwidth.measured
    # A fresh kvstore (empty DRAM and SSD, no in-memory sequence) on the same bucket: the
    # manifest names the partial chunk, so a 50-block prompt still reuses 40.
    pool.kv_cache[DST:].zero_()
    async with build_store(cfg(tmp_path, s3, "b", range_bytes), KVStoreMetrics()) as store, \
            EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        r = await dp.lookup(LookupRequest(TENANT, "chat", MODEL, hs, 0, LAYERS))
        assert r.matched_blocks == 40
        assert [(s.first_block, s.use_blocks, s.tier) for s in r.spans] == [
            (0, 16, "s3"), (16, 16, "s3"), (32, 8, "s3")]
        msgs = [m async for m in dp.load(LoadRequest(
            pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 40, DST, STRIDE)), LAYERS,
        ))]
        assert all(m.ok for m in msgs)
        assert torch.equal(pool.kv_cache[layer_blocks(DST, 2, 0, 40)],
                           saved[layer_blocks(SRC, 2, 0, 40)])


async def test_a_forged_range_of_an_s3_chunk_fails_its_layer(
    tmp_path: Path, s3_endpoint: str, pool
) -> None:
    """A byte changed past the first range (so it arrives in a parallel ranged GET, straight
    into the blocks): the chunk's MAC fails over the blocks, the copy is counted and
    deleted, and the load stops at that layer (the engine recomputes from there)."""
    import boto3

    from tests.s3_server import aws_keys

    s3 = s3cfg(s3_endpoint, f"kv-{uuid.uuid4().hex[:12]}")
    hs = hashes(16)
    fill(pool, ids(0, 16, SRC, STRIDE), seed=12)
    saved = pool.kv_cache.clone()
    async with build_store(cfg(tmp_path, s3, "a", 8192), KVStoreMetrics()) as store, \
            EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        await dp.save(SaveRequest(pid, TENANT, "chat", MODEL, hs, 16 * 16, 0,
                                  tuple(ids(0, 16, SRC, STRIDE)), LAYERS))
        await dp.wait_manifests()
        for tier in store.tiers[:2]:
            for key in tier._index.keys():
                await tier.delete(key)
        raw = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                           **aws_keys())
        obj = s3.prefix + "c/" + chunk_key(TENANT, MODEL, hs[-1], 1)  # layer 1
        data = bytearray(raw.get_object(Bucket=s3.bucket, Key=obj)["Body"].read())
        assert len(data) > 3 * 8192  # several ranges
        data[-7] ^= 0x10  # in the last range
        raw.put_object(Bucket=s3.bucket, Key=obj, Body=bytes(data))
        r = await dp.lookup(LookupRequest(TENANT, "chat", MODEL, hs, 0, LAYERS))
        assert r.matched_blocks == 16
        pool.kv_cache[DST:].zero_()
        msgs = [m async for m in dp.load(LoadRequest(
            pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(ids(0, 16, DST, STRIDE)), LAYERS,
        ))]
        assert [(m.layer, m.ok) for m in msgs] == [(0, True), (1, False)]
        assert torch.equal(pool.kv_cache[layer_blocks(DST, 0, 0, 16)],
                           saved[layer_blocks(SRC, 0, 0, 16)])
        assert store.metrics.value("kvstore_checksum_failures_total", tier="s3") == 1
        assert not await store.lowest.contains(obj.removeprefix(s3.prefix))


def pb_geometry(pool, layers: int = LAYERS) -> pb.PoolGeometry:
    g = geometry(pool, layers)
    return pb.PoolGeometry(
        pool_name=g.pool_name, device=g.device, num_blocks=g.num_blocks, block_size=g.block_size,
        num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, dtype=g.dtype,
        num_layers=g.num_layers, model_fp=g.model_fp,
    )


async def test_grpc_pool_path_with_a_real_kvstore_process(tmp_path: Path, pool) -> None:
    kv = KVStoreProcess(
        ["--ssd-path", str(tmp_path / "db"), "--chunk-tokens", str(CHUNK_TOKENS)],
        tmp_path / "kv.log",
    )
    try:
        kv.wait_ready()
        hs = hashes(40)
        fill(pool, ids(0, 40, SRC, STRIDE), seed=12)
        saved = pool.kv_cache.clone()
        async with channel(kv.address) as ch:
            st = stub(ch)
            att = await st.AttachPool(pb.AttachPoolRequest(pool=pb_geometry(pool)))
            assert att.pool_id and att.blocks_per_chunk == 16
            again = await st.AttachPool(pb.AttachPoolRequest(pool=pb_geometry(pool)))
            assert again.pool_id == att.pool_id
            saved_reply = await st.SaveFromPool(pb.SaveFromPoolRequest(
                pool_id=att.pool_id, tenant=TENANT, session_id="chat", model_fp=MODEL,
                block_hashes=list(hs), token_count=40 * 16 + 5, first_block=0,
                block_ids=ids(0, 40, SRC, STRIDE), num_layers=LAYERS))
            assert (saved_reply.chunks_written, saved_reply.chunks_skipped) == (9, 0)
            pool.kv_cache.zero_()  # the engine purged its copy; the kvstore has it

            found = await st.LookupPrefix(pb.LookupPrefixRequest(
                tenant=TENANT, session_id="chat", model_fp=MODEL, block_hashes=list(hs),
                first_block=0, num_layers=LAYERS))
            assert found.matched_blocks == 40 and found.lease_id
            spans = [(s.first_block, s.use_blocks) for s in found.spans]
            assert spans == [(0, 16), (16, 16), (32, 8)]
            assert found.tier_bytes_per_s["dram"] > 0

            layers = []
            stream = st.LoadIntoPool(pb.LoadIntoPoolRequest(
                pool_id=att.pool_id, lease_id=found.lease_id, tenant=TENANT, model_fp=MODEL,
                spans=found.spans, block_ids=ids(0, 40, DST, STRIDE), num_layers=LAYERS))
            async for msg in stream:
                assert msg.ok, msg.error
                # readiness per layer: this layer's blocks are in place when its message comes
                assert torch.equal(pool.kv_cache[layer_blocks(DST, msg.layer, 0, 40)],
                                   saved[layer_blocks(SRC, msg.layer, 0, 40)])
                layers.append(msg.layer)
            assert layers == [0, 1, 2]

            again = await st.LookupPrefix(pb.LookupPrefixRequest(
                tenant=TENANT, session_id="chat", model_fp=MODEL, block_hashes=list(hs),
                first_block=16, num_layers=LAYERS))
            assert again.matched_blocks == 40 and len(again.spans) == 2
            await st.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=again.lease_id))

            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await st.SaveFromPool(pb.SaveFromPoolRequest(
                    pool_id=att.pool_id, tenant=TENANT, session_id="chat", model_fp=MODEL,
                    block_hashes=list(hs), token_count=640, first_block=8,
                    block_ids=ids(8, 32, SRC, STRIDE), num_layers=LAYERS))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "blocks_per_chunk" in bad.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await st.LookupPrefix(pb.LookupPrefixRequest(
                    tenant=TENANT, model_fp="other-model", block_hashes=list(hs), num_layers=3))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # A fence for a call not seen yet retires its id: arriving later, it is refused.
            await st.FencePoolOp(pb.FencePoolOpRequest(op_id="engine-1-7"), timeout=10)
            pool.kv_cache[DST:].zero_()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in st.LoadIntoPool(pb.LoadIntoPoolRequest(
                        pool_id=att.pool_id, tenant=TENANT, model_fp=MODEL, spans=found.spans,
                        block_ids=ids(0, 40, DST, STRIDE), num_layers=LAYERS,
                        op_id="engine-1-7")):
                    pass
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fenced" in bad.value.details()
            assert not pool.kv_cache[DST:].any()
    finally:
        assert kv.stop() == 0
    log = (tmp_path / "kv.log").read_text()
    assert "Traceback" not in log


async def test_grpc_attach_names_chunk_tokens_when_not_a_multiple(tmp_path: Path, pool) -> None:
    kv = KVStoreProcess(["--chunk-tokens", "200"], tmp_path / "kv.log")
    try:
        kv.wait_ready()
        async with channel(kv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub(ch).AttachPool(pb.AttachPoolRequest(pool=pb_geometry(pool)))
            assert bad.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "kvstore.chunk_tokens" in bad.value.details()
    finally:
        assert kv.stop() == 0
