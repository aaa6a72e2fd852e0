"""A 6-turn greedy fp32 conversation: turns 2-6 equal full recomputation token for token,
with the history's KV coming from each tier in turn (device, DRAM, SSD, S3)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.model import LoadedModel
from tests.integration.reuse.harness import (
    engine,
    kvstore,
    kvstore_config,
    reference_transcript,
    run_turn,
    saves_settled,
    turn_request,
)
from tests.s3_server import free_port, s3_keys


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel):
    return asyncio.run(reference_transcript(loaded))


async def stats(eng: AsyncEngine):
    return (await eng.status()).reuse


async def test_history_from_device(loaded: LoadedModel, reference, tmp_path: Path) -> None:
    async with kvstore(kvstore_config(0, None)) as kv, engine(loaded, kv.address) as eng:
        for i, (msgs, want, _) in enumerate(reference):
            before = await stats(eng)
            got, _, cached = await run_turn(eng, turn_request(msgs, "dev"))
            assert got == want, f"turn {i + 1} differs from recomputation"
            after = await stats(eng)
            if i:
                assert cached > 0 and after.device_tokens - before.device_tokens == cached
                assert after.loaded_tokens == before.loaded_tokens  # nothing needed loading
        await saves_settled(eng)
        after = await stats(eng)
        assert after.saves >= len(reference) and after.save_errors == 0
        await eng.check_integrity()


async def test_history_from_dram(loaded: LoadedModel, reference, tmp_path: Path) -> None:
    async with kvstore(kvstore_config(0, None)) as kv, engine(loaded, kv.address) as eng:
        for i, (msgs, want, _) in enumerate(reference):
            await saves_settled(eng)
            await eng.drop_device_cache()  # the device tier forgets the history
            before = await stats(eng)
            got, _, cached = await run_turn(eng, turn_request(msgs, "dram"))
            assert got == want, f"turn {i + 1} differs from recomputation"
            after = await stats(eng)
            if i:
                loaded_now = after.loaded_tokens.get("dram", 0) - before.loaded_tokens.get(
                    "dram", 0)
                assert loaded_now > 0 and cached == loaded_now
                assert after.device_tokens == before.device_tokens
        assert after.load_failures == 0
        await eng.check_integrity()


async def test_history_from_ssd(loaded: LoadedModel, reference, tmp_path: Path) -> None:
    """The kvstore restarts before every turn (same RocksDB): DRAM is empty, SSD holds all."""
    cfg = kvstore_config(free_port(), tmp_path / "ssd")
    async with engine(loaded, f"127.0.0.1:{cfg.port}", attach=False) as eng:
        for i, (msgs, want, _) in enumerate(reference):
            async with kvstore(cfg):
                assert await eng.kv_connector.attach(timeout=10.0)
                await eng.drop_device_cache()
                before = await stats(eng)
                got, _, cached = await run_turn(eng, turn_request(msgs, "ssd"))
                assert got == want, f"turn {i + 1} differs from recomputation"
                after = await stats(eng)
                await saves_settled(eng)
            if i:
                loaded_now = after.loaded_tokens.get("ssd", 0) - before.loaded_tokens.get("ssd", 0)
                assert loaded_now > 0 and cached == loaded_now
        assert after.load_failures == 0
        await eng.check_integrity()


async def test_history_from_s3(
    loaded: LoadedModel, reference, tmp_path: Path, s3_endpoint: str
) -> None:
    """Every turn gets a fresh kvstore (empty DRAM, a new RocksDB) on the same bucket: the
    history comes back from S3 through the session manifest."""
    s3 = {"endpoint_url": s3_endpoint, "bucket": f"kv-{uuid.uuid4().hex[:12]}",
          **s3_keys(), "backoff_s": 0.01,
          "backoff_max_s": 0.05, "max_attempts": 2, "timeout_s": 2.0}
    port = free_port()
    async with engine(loaded, f"127.0.0.1:{port}", attach=False) as eng:
        for i, (msgs, want, _) in enumerate(reference):
            async with kvstore(kvstore_config(port, tmp_path / f"ssd{i}", s3)):
                assert await eng.kv_connector.attach(timeout=10.0)
                await eng.drop_device_cache()
                before = await stats(eng)
                got, _, cached = await run_turn(eng, turn_request(msgs, "s3"))
                assert got == want, f"turn {i + 1} differs from recomputation"
                after = await stats(eng)
                await saves_settled(eng)
            if i:
                loaded_now = after.loaded_tokens.get("s3", 0) - before.loaded_tokens.get("s3", 0)
                assert loaded_now > 0 and cached == loaded_now
        assert after.load_failures == 0
