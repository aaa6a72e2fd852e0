"""The S3 tier and the store against a real S3 server (SeaweedFS) on loopback."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from services.kvstore.config import KVStoreConfig, S3Config
from services.kvstore.errors import TierUnavailable
from services.kvstore.manifests import ManifestStore
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.server import build_store
from services.kvstore.tiers import S3Tier
from shared.config import build
from tests.s3_server import aws_keys, free_port, s3_keys, start_s3_server
from tests.unit.kvstore.chunks import kv_tensor, meta, session_chunks, session_manifest


def s3cfg(endpoint: str, bucket: str | None = None, **kw: object) -> S3Config:
    return build(
        S3Config,
        {
            "endpoint_url": endpoint,
            "bucket": bucket or f"kv-{uuid.uuid4().hex[:12]}",
            **s3_keys(),
            "backoff_s": 0.01,
            "backoff_max_s": 0.05,
            "max_attempts": 2,
            "timeout_s": 1.0,
            **kw,
        },
    )


def store_cfg(tmp_path: Path, s3: S3Config, **kw: object) -> KVStoreConfig:
    import dataclasses

    return build(
        KVStoreConfig,
        {
            "ssd_path": str(tmp_path / "db"),
            "ssd_bytes": 1 << 24,
            "dram_bytes": 1 << 22,
            "retry_backoff_max_s": 0.05,
            "drain_s": 0.5,
            "s3": dataclasses.asdict(s3),
            **kw,
        },
    )


async def test_s3_tier_contract(s3_endpoint: str) -> None:
    t = S3Tier(s3cfg(s3_endpoint))
    await t.open()
    try:
        assert await t.get("a/b") is None
        assert await t.put("a/b", bytearray(b"hello")) == []
        assert await t.get("a/b") == b"hello"
        assert await t.contains("a/b") and not await t.contains("a/c")
        assert await t.scan_expired(time.time() - 3600) == []
        assert await t.scan_expired(time.time() + 3600) == ["a/b"]
        assert await t.delete("a/b")
        assert await t.get("a/b") is None
        assert t.stats().healthy
    finally:
        await t.close()


async def test_store_writes_through_to_s3_and_serves_after_local_loss(
    s3_endpoint: str, tmp_path: Path
) -> None:
    cfg = store_cfg(tmp_path, s3cfg(s3_endpoint))
    async with build_store(cfg, KVStoreMetrics()) as s:
        m = session_manifest("sess", num_blocks=3, num_layers=2, bpc=2)
        for cm, t in session_chunks(m):
            await s.put(cm, t)
        await ManifestStore(s).put_manifest(m)
        s3 = s.lowest
        assert isinstance(s3, S3Tier)
        for key in m.chunk_keys():
            await s.dram.delete("c/" + key)
            await s.tiers[1].delete("c/" + key)
        for (_cm, t), key in zip(session_chunks(m), m.chunk_keys(), strict=False):
            c = await s.get(key)
            assert c is not None and torch.equal(c.tensor, t)
        assert s.metrics.value("kvstore_hits_total", tier="s3") == 4
        assert await s.tiers[1].contains("c/" + m.chunk_keys()[0])  # promoted back to SSD
    # a fresh store (another node sharing the bucket) finds the manifest in S3
    cfg2 = store_cfg(tmp_path / "n2", cfg.s3)
    async with build_store(cfg2, KVStoreMetrics()) as s2:
        assert await ManifestStore(s2).get_manifest("t1", "sess") == m


async def test_corrupt_s3_object_is_a_counted_miss(s3_endpoint: str, tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path, s3cfg(s3_endpoint), tiers=["dram", "s3"])
    async with build_store(cfg, KVStoreMetrics()) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(1))
        await r.durable
        await s.dram.delete("c/" + r.key)
        raw = boto3.client(
            "s3",
            endpoint_url=s3_endpoint,
            region_name="us-east-1",
            **aws_keys(),
        )
        obj_key = cfg.s3.prefix + "c/" + r.key
        data = bytearray(raw.get_object(Bucket=cfg.s3.bucket, Key=obj_key)["Body"].read())
        data[len(data) // 2] ^= 0x01
        raw.put_object(Bucket=cfg.s3.bucket, Key=obj_key, Body=bytes(data))
        assert await s.get(r.key) is None
        assert s.metrics.value("kvstore_checksum_failures_total", tier="s3") == 1
        assert not await s.lowest.contains("c/" + r.key)


async def test_ttl_sweep_expires_lowest_tier(s3_endpoint: str, tmp_path: Path) -> None:
    cfg = store_cfg(tmp_path, s3cfg(s3_endpoint), tiers=["dram", "s3"], ttl_s=60)
    async with build_store(cfg, KVStoreMetrics()) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(1))
        await r.durable
        assert await s.sweep(now=time.time() + 30) == 0
        assert await s.sweep(now=time.time() + 120) >= 1
        assert not await s.lowest.contains("c/" + r.key)


async def test_s3_unreachable_degrades_queues_drops_and_recovers(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here yet: S3 is down
    cfg = store_cfg(tmp_path, s3cfg(f"http://127.0.0.1:{port}"), write_queue=4, write_workers=1)
    async with build_store(cfg, KVStoreMetrics()) as s:
        healthy, detail = s.health()
        assert not healthy and "s3 degraded" in detail
        receipts = [await s.put(meta("s", i, 0), kv_tensor(i), priority=i % 2) for i in range(8)]
        await asyncio.sleep(0.3)
        dropped = [i for i, r in enumerate(receipts) if r.durable.done()]
        assert len(dropped) >= 3 and s.metrics.value("kvstore_write_behind_dropped_total") == len(
            dropped
        )
        assert all(i % 2 == 0 for i in dropped[:3])  # priority 0 goes first
        for i, r in enumerate(receipts):  # gets fall back to local tiers, never wrong data
            c = await s.get(r.key)
            assert c is not None and torch.equal(c.tensor, kv_tensor(i))
        _url, stop = start_s3_server(port=port)
        try:
            kept = [r for i, r in enumerate(receipts) if i not in dropped]
            await asyncio.wait_for(asyncio.gather(*(r.durable for r in kept)), 20)
            assert s.health()[0]
        finally:
            stop()


async def test_a_degraded_s3_tier_probes_instead_of_hammering_the_endpoint() -> None:
    """While degraded, one call at a time reaches the endpoint, at most once per pause;
    the rest fail at once. When S3 is back, the next probe heals the tier."""
    port = free_port()
    t = S3Tier(s3cfg(f"http://127.0.0.1:{port}", backoff_s=0.05, backoff_max_s=0.2, max_attempts=3))
    await t.open()  # unreachable: opens degraded
    sent: list[float] = []
    t._client.meta.events.register("before-send.s3.*", lambda **kw: sent.append(time.monotonic()))
    try:
        assert t.degraded
        t0 = time.monotonic()
        failed = 0
        while time.monotonic() - t0 < 1.0:  # a write-behind retrying flat out for a second
            results = await asyncio.gather(
                *(t.put(f"c/k{i}", b"x") for i in range(8)), return_exceptions=True
            )
            failed += sum(isinstance(r, TierUnavailable) for r in results)
            await asyncio.sleep(0.01)
        assert failed > 100
        assert len(sent) <= 12  # ~1 s / 0.2 s pauses, plus the first short ones
        _url, stop = start_s3_server(port=port)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    await t.put("c/back", b"x")
                    break
                except TierUnavailable:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            assert not t.degraded and await t.contains("c/back")
        finally:
            stop()
    finally:
        await t.close()


async def test_s3_refresh_restarts_an_objects_ttl_clock(s3_endpoint: str) -> None:
    """``written_at`` is the object's LastModified; ``refresh`` (a copy onto itself)
    moves it to now without changing the bytes; both tell an absent key."""
    t = S3Tier(s3cfg(s3_endpoint))
    await t.open()
    try:
        await t.put("c/k", b"payload")
        first = await t.written_at("c/k")
        assert first is not None and abs(first - time.time()) < 5
        await asyncio.sleep(1.1)  # LastModified has one-second resolution
        assert await t.refresh("c/k")
        second = await t.written_at("c/k")
        assert second is not None and second > first
        assert await t.get("c/k") == b"payload"
        assert await t.written_at("c/absent") is None
        assert not await t.refresh("c/absent")
    finally:
        await t.close()


async def test_s3_batch_reads_run_together_and_end_together(s3_endpoint: str) -> None:
    """A layer's chunks are fetched concurrently, each checked on its S3 thread, results in
    key order; if one fails, the call returns only after the others' checks are done (a
    check may be writing into an engine's pool blocks)."""
    import threading

    t = S3Tier(s3cfg(s3_endpoint))
    await t.open()
    try:
        keys = [f"c/k{i}" for i in range(4)]
        for i, k in enumerate(keys):
            await t.put(k, bytes([i]) * 16)
        together = threading.Barrier(2, timeout=10)  # only passes with two checks in flight

        def check(hit):
            if hit.blob()[0] < 2:
                together.wait()
            return (threading.current_thread().name, bytes(hit.blob()))

        got = await t.get_many_checked([*keys, "c/absent"], check)
        assert [g[1][1] for g in got[:4]] == [bytes([i]) * 16 for i in range(4)]
        assert got[4] is None
        assert all(g[1][0].startswith("kv-s3") for g in got[:4])
        assert await t.get_many(keys[:2]) == [bytes([0]) * 16, bytes([1]) * 16]

        finished: list[str] = []

        def failing(hit):
            if hit.blob()[0] == 0:
                raise RuntimeError("a bug in a check")
            threading.Event().wait(0.3)
            finished.append("slow")
            return 1

        with pytest.raises(RuntimeError):
            await t.get_many_checked(keys[:2], failing)
        assert finished == ["slow"]
    finally:
        await t.close()
