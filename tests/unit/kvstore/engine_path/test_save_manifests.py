"""SaveFromPool's session bookkeeping: background manifests, session deletes, bounds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.kvstore.engine_path import save as save_mod
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import SaveRequest
from services.kvstore.manifests import latest as latest_mod
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store import TieredStore
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import ChunkFormatError
from tests.unit.kvstore.flaky import FlakyTier
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


class GatedManifests(FlakyTier):
    """A lowest tier whose first manifest put waits for ``gate`` (setting ``entered``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = asyncio.Event(), asyncio.Event()

    async def put(self, key: str, blob, priority: int = 0) -> list[str]:
        if key.startswith("m/") and not self.entered.is_set():
            self.entered.set()
            await self.gate.wait()
        return await super().put(key, blob, priority)


@pytest.fixture
def pool():
    p = make_pool()
    fill(p, ids(0, 48, 0, 64), seed=1)
    yield p
    p.close()


def request(pid: str, hs: tuple[bytes, ...], session: str = "s", **kw) -> SaveRequest:
    n = len(hs)
    fields = {"pool_id": pid, "tenant": TENANT, "session_id": session, "model_fp": MODEL,
                  "block_hashes": hs, "token_count": n * 16, "first_block": 0,
                  "block_ids": tuple(ids(0, n, 0, 64)), "num_layers": LAYERS}
    fields.update(kw)
    return SaveRequest(**fields)


@contextlib.asynccontextmanager
async def superseded_while_writing(pool) -> AsyncIterator[tuple[GatedManifests, TieredStore,
                                                               EnginePoolPath]]:
    """A session saved twice: the first sequence's manifest is being written (held at the
    remote's gate) when the second save supersedes it."""
    remote = GatedManifests()
    store = TieredStore([DramTier(1 << 24), remote], KVStoreMetrics(), drain_s=0.5)
    async with store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        await dp.save(request(pid, hashes(20)))
        await asyncio.wait_for(remote.entered.wait(), 5)  # its manifest is being written
        await dp.save(request(pid, hashes(40)))  # supersedes it; the write goes on
        yield remote, store, dp


async def test_a_deleted_session_stays_deleted_with_an_older_manifest_still_writing(pool) -> None:
    async with superseded_while_writing(pool) as (remote, _store, dp):
        deleting = asyncio.create_task(dp.forget(TENANT, scoped_session("s", MODEL)))
        await asyncio.sleep(0.05)
        assert not deleting.done()  # it waits for the write under way ...
        remote.gate.set()
        await deleting
        # ... so the caller's delete comes last
        await dp.manifests.delete_manifest(TENANT, scoped_session("s", MODEL))
        await dp.wait_manifests()
        assert await dp.manifests.get_manifest(TENANT, scoped_session("s", MODEL)) is None


async def test_the_newest_manifest_is_the_one_that_stays(pool) -> None:
    async with superseded_while_writing(pool) as (remote, _store, dp):
        await asyncio.sleep(0.1)  # the newer one is durable and waits for the older write
        remote.gate.set()
        await dp.wait_manifests()
        m = await dp.manifests.get_manifest(TENANT, scoped_session("s", MODEL))
        assert m is not None and len(m.block_hashes) == 40


async def test_a_session_deleted_while_a_save_runs_is_not_brought_back(
    pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = save_mod.encode_from_pool

    def slow(kv, jobs):
        time.sleep(0.3)
        return real(kv, jobs)

    monkeypatch.setattr(save_mod, "encode_from_pool", slow)
    store = TieredStore([DramTier(1 << 24), SsdTier(str(tmp_path / "db"), 1 << 24)],
                        KVStoreMetrics(), drain_s=0.5)
    async with store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        saving = asyncio.create_task(dp.save(request(pid, hashes(20))))
        await asyncio.sleep(0.05)  # copying blocks
        await dp.forget(TENANT, scoped_session("s", MODEL))
        await dp.manifests.delete_manifest(TENANT, scoped_session("s", MODEL))
        await saving
        await dp.wait_manifests()
        assert await dp.manifests.get_manifest(TENANT, scoped_session("s", MODEL)) is None
        assert (TENANT, "s") not in dp.manifests.sequences
        await dp.save(request(pid, hashes(20)))  # a save after the delete is remembered
        await dp.wait_manifests()
        assert await dp.manifests.get_manifest(TENANT, scoped_session("s", MODEL)) is not None


async def test_a_refused_save_stores_and_remembers_nothing(pool) -> None:
    store = TieredStore([DramTier(1 << 24)], KVStoreMetrics())
    async with store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        hs = hashes(20)
        for bad in ({"session_id": "a/b"}, {"tenant": ""},
                    {"tenant": "", "first_block": 16, "block_ids": tuple(ids(16, 4, 0, 64))}):
            with pytest.raises(ChunkFormatError):
                await dp.save(request(pid, hs, **bad))
        assert store.stats()[0].entries == 0 and not dp.manifests.sequences
        await dp.wait_manifests()


async def test_remembered_sequences_are_bounded_by_their_hashes(
    pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(latest_mod, "LATEST_HASHES", 50)
    store = TieredStore([DramTier(1 << 24)], KVStoreMetrics())
    async with store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
        pid, _ = await dp.attach(geometry(pool))
        for i in range(4):  # 16 hashes each, nothing to copy (first_block = all)
            await dp.save(request(pid, hashes(16, tag=f"t{i}"), session=f"s{i}",
                                  first_block=16, block_ids=()))
        assert list(dp.manifests.sequences) == [(TENANT, scoped_session(f"s{i}", MODEL))
                                                for i in (1, 2, 3)]
        assert dp.manifests.sequences.hashes == 48
        await dp.wait_manifests()


async def test_one_session_under_two_models_keeps_a_manifest_each(pool) -> None:
    """A session that switches model (Prism: models share nodes) keeps each model's
    manifest; saving under one does not overwrite the other's."""
    other = make_pool()
    try:
        store = TieredStore([DramTier(1 << 24)], KVStoreMetrics())
        async with store, EnginePoolPath(store, CHUNK_TOKENS) as dp:
            pid_a, _ = await dp.attach(geometry(pool))
            pid_b, _ = await dp.attach(geometry(other, model_fp="fp1"))
            hs_a, hs_b = hashes(32, tag="a"), hashes(16, tag="b")
            await dp.save(request(pid_a, hs_a, session="chat"))
            await dp.save(request(pid_b, hs_b, session="chat", model_fp="fp1",
                                  block_ids=tuple(ids(0, 16, 0, 64))))
            await dp.wait_manifests()
            a = await dp.manifests.get_manifest(TENANT, scoped_session("chat", MODEL))
            b = await dp.manifests.get_manifest(TENANT, scoped_session("chat", "fp1"))
            assert a is not None and a.model_fp == MODEL and a.block_hashes == hs_a
            assert b is not None and b.model_fp == "fp1" and b.block_hashes == hs_b
            assert sorted(dp.manifests.model_scopes(TENANT, "chat")) == sorted(
                [scoped_session("chat", MODEL), scoped_session("chat", "fp1")])
    finally:
        other.close()
