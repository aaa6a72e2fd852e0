"""A corrupt or missing chunk in the middle of a layer-wise load: the request falls back to
recomputation, its output equals recomputation, and the failure is counted."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import boto3
import pytest

from bench.harness import CLUSTER_SECRET
from services.engine.model import LoadedModel
from services.kvstore.tiers import SsdTier
from shared import internal_auth
from shared.chunk_codec import parse_head, seal_chunk
from tests.integration.reuse.harness import (
    engine,
    kvstore,
    kvstore_config,
    reference_transcript,
    run_turn,
    saves_settled,
    turn_request,
)
from tests.s3_server import aws_keys, free_port, s3_keys
from tests.unit.kvstore.tier_faults import lose, overwrite

TURNS = ["Tell me a story about a robot that learns to paint.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel):
    return asyncio.run(reference_transcript(loaded, TURNS))


def flip(blob: bytes) -> bytes:
    """Flip bytes in the tensor payload (the tail of the blob)."""
    b = bytearray(blob)
    for i in range(1, 9):
        b[-i] ^= 0xFF
    return bytes(b)


async def damage_ssd(path: Path, layer: int, how: str) -> int:
    """Flip payload bytes of (``corrupt``) or lose the stored bytes of (``missing``, the
    catalog entry stays, so lookups still see it) every chunk of ``layer`` in a closed
    kvstore's SSD tier."""
    ssd = SsdTier(str(path), 1 << 40)
    await ssd.open()
    try:
        keys = [k for k in ssd.keys() if k.startswith("c/") and k.endswith(f"/{layer}")]
        for k in keys:
            if how == "corrupt":
                await overwrite(ssd, k, flip(await ssd.get(k)))
            else:
                await lose(ssd, k)
    finally:
        await ssd.close()
    return len(keys)


@pytest.mark.parametrize("how", ["corrupt", "missing"])
async def test_bad_ssd_chunk_mid_load_falls_back(
    loaded: LoadedModel, reference, tmp_path: Path, how: str
) -> None:
    cfg = kvstore_config(free_port(), tmp_path / "ssd")
    (msgs1, want1, _), (msgs2, want2, _) = reference
    async with engine(loaded, f"127.0.0.1:{cfg.port}", attach=False) as eng:
        async with kvstore(cfg):
            assert await eng.kv_connector.attach(timeout=10.0)
            assert (await run_turn(eng, turn_request(msgs1, "c")))[0] == want1
            await saves_settled(eng)
        assert await damage_ssd(cfg.ssd_path, 1, how) > 0  # layer 0 loads, layer 1 fails
        async with kvstore(cfg):
            assert await eng.kv_connector.attach(timeout=10.0)
            await eng.drop_device_cache()
            before = (await eng.status()).reuse
            got, _, cached = await run_turn(eng, turn_request(msgs2, "c"))
            after = (await eng.status()).reuse
            await saves_settled(eng)
        assert got == want2
        assert after.load_failures == before.load_failures + 1
        assert after.loaded_tokens == before.loaded_tokens and cached == 0
        await eng.check_integrity()


async def test_corrupt_s3_chunk_falls_back(
    loaded: LoadedModel, reference, tmp_path: Path, s3_endpoint: str
) -> None:
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    s3 = {"endpoint_url": s3_endpoint, "bucket": bucket, **s3_keys(), "backoff_s": 0.01,
          "backoff_max_s": 0.05,
          "max_attempts": 2, "timeout_s": 2.0}
    port = free_port()
    (msgs1, want1, _), (msgs2, want2, _) = reference
    async with engine(loaded, f"127.0.0.1:{port}", attach=False) as eng:
        async with kvstore(kvstore_config(port, tmp_path / "a", s3)):
            assert await eng.kv_connector.attach(timeout=10.0)
            assert (await run_turn(eng, turn_request(msgs1, "s")))[0] == want1
            await saves_settled(eng)
        client = boto3.client("s3", endpoint_url=s3_endpoint, **aws_keys(), region_name="us-east-1")
        objects = client.list_objects_v2(Bucket=bucket)["Contents"]
        layer0 = [o["Key"] for o in objects if o["Key"].endswith("/0")]
        assert layer0
        for key in layer0:  # the very first layer fails: nothing is usable
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.put_object(Bucket=bucket, Key=key, Body=flip(body))
        async with kvstore(kvstore_config(port, tmp_path / "b", s3)):
            assert await eng.kv_connector.attach(timeout=10.0)
            await eng.drop_device_cache()
            before = (await eng.status()).reuse
            got, _, cached = await run_turn(eng, turn_request(msgs2, "s"))
            after = (await eng.status()).reuse
            await saves_settled(eng)
        assert got == want2
        assert after.load_failures == before.load_failures + 1 and cached == 0
        await eng.check_integrity()


async def test_kvstore_down_never_fails_requests(loaded: LoadedModel, reference) -> None:
    """No kvstore listening: requests run (recomputing) and saves are skipped."""
    (msgs1, want1, _), _ = reference
    async with engine(loaded, f"127.0.0.1:{free_port()}", attach=False) as eng:
        assert (await run_turn(eng, turn_request(msgs1, "down")))[0] == want1
        await saves_settled(eng)
        st = (await eng.status()).reuse
        assert not st.attached and st.save_errors == 1
        await eng.check_integrity()


def forge(blob: bytes, secret: str | None) -> bytes:
    """``blob`` with its KV replaced (every payload byte zero but the last few flipped) and
    sealed again the way anyone without the cluster secret can: a valid tag under
    ``secret`` (another cluster's, or none: the unkeyed root)."""
    b = bytearray(blob)
    head = parse_head(b, len(b))
    b[head.payload_offset:] = bytes(len(b) - head.payload_offset)
    b[6:8] = b"\0\0"  # unsealed, so seal_chunk computes a fresh tag
    internal_auth.configure(secret)
    try:
        seal_chunk(b)
    finally:
        internal_auth.configure(CLUSTER_SECRET)
    return bytes(b)


@pytest.mark.parametrize("attacker", [None, "another-clusters-secret"])
async def test_a_forged_s3_chunk_is_refused_and_the_turn_recomputed(
    loaded: LoadedModel, reference, tmp_path: Path, s3_endpoint: str, attacker: str | None
) -> None:
    """Issue 43: chunks in the shared bucket re-sealed by someone without the cluster
    secret (a valid checksum by any unkeyed measure) are refused like corrupt ones, and
    the turn answers exactly what recomputation answers."""
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    s3 = {"endpoint_url": s3_endpoint, "bucket": bucket, **s3_keys(), "backoff_s": 0.01,
          "backoff_max_s": 0.05, "max_attempts": 2, "timeout_s": 2.0}
    port = free_port()
    (msgs1, want1, _), (msgs2, want2, _) = reference
    async with engine(loaded, f"127.0.0.1:{port}", attach=False) as eng:
        async with kvstore(kvstore_config(port, tmp_path / "a", s3)):
            assert await eng.kv_connector.attach(timeout=10.0)
            assert (await run_turn(eng, turn_request(msgs1, "f")))[0] == want1
            await saves_settled(eng)
        client = boto3.client("s3", endpoint_url=s3_endpoint, **aws_keys(),
                              region_name="us-east-1")
        chunks = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]
                  if "/c/" in o["Key"]]
        assert chunks
        for key in chunks:  # every layer forged
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.put_object(Bucket=bucket, Key=key, Body=forge(body, attacker))
        async with kvstore(kvstore_config(port, tmp_path / "b", s3)) as kv:
            assert await eng.kv_connector.attach(timeout=10.0)
            await eng.drop_device_cache()
            before = (await eng.status()).reuse
            got, _, cached = await run_turn(eng, turn_request(msgs2, "f"))
            after = (await eng.status()).reuse
            await saves_settled(eng)
            refused = kv.pool_path.store.metrics.value("kvstore_checksum_failures_total", tier="s3")
        assert got == want2  # the forged KV was not used
        assert after.load_failures == before.load_failures + 1 and cached == 0
        assert refused >= 1
        await eng.check_integrity()
