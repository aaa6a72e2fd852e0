"""prompt_cache_retention in the kvstore: the manifest records it, a session past it is
swept (its manifest, and the chunks nobody used since), and until then its entries outlive
the local tiers' idle TTL."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from services.kvstore.manifests import Manifest, ManifestStore
from services.kvstore.manifests.latest import SavedSequence
from services.kvstore.manifests.retention import RetentionIndex
from services.kvstore.manifests.retention_sweep import sweep_retention
from services.kvstore.store import TieredStore
from services.kvstore.store.keys import manifest_tier_key
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import ChunkFormatError
from shared.session_key import SessionKey
from tests.unit.kvstore.chunks import TENANT, session_chunks, session_manifest
from tests.unit.kvstore.stores import make_store


def _retained(session: str, retain_s: float, updated: float) -> Manifest:
    m = session_manifest(session, num_blocks=4, num_layers=2, bpc=2)
    return dataclasses.replace(m, retain_s=retain_s, updated=updated)


async def _save(s: TieredStore, manifests: ManifestStore, m: Manifest) -> Manifest:
    """What a SaveFromPool does: the chunks into the store, then the sequence remembered
    (its manifest dated after them, unless ``m`` is dated later still)."""
    for cm, t in session_chunks(m):
        await (await s.put(cm, t)).durable
    m = dataclasses.replace(m, updated=max(m.updated, time.time()))
    seq = SavedSequence(m.model_fp, m.block_hashes, m.token_count, m.num_layers)
    manifests.remember(seq, m, manifests.deletions(m.tenant, m.session_id))
    await manifests.wait_pending()
    return m


async def _held(s: TieredStore, key: str) -> bool:
    return any([await t.contains("c/" + key) for t in s.tiers])


def test_the_manifest_records_its_retention_and_reads_it_back() -> None:
    m = _retained("r", 600.0, time.time())
    assert Manifest.decode(m.encode(), m.key).retain_s == 600.0
    plain = session_manifest("p", 2, 1, 2)
    assert Manifest.decode(plain.encode(), plain.key).retain_s == 0.0  # (older manifests)
    with pytest.raises(ChunkFormatError):
        dataclasses.replace(m, retain_s=float("nan"))


def test_the_index_bounds_retention_and_sessions() -> None:
    index = RetentionIndex(max_retain_s=3600.0, max_sessions=2)
    assert index.bound(86400.0) == 3600.0 and index.bound(-1.0) == 0.0
    now = time.time()
    for i in range(3):
        index.note(_retained(f"s{i}", 10.0, now))
    assert len(index) == 2  # the oldest noted falls back to the tiers' TTLs
    index.note(_retained("s2", 0.0, now))  # its newest turn asked for no retention
    assert len(index) == 1
    assert index.expired(now + 5) == []
    assert [m.session_id for m in index.expired(now + 11)] == ["s1"]
    assert len(index) == 0


async def test_a_session_past_its_retention_is_swept(tmp_path: Path) -> None:
    """An "in_memory" session (minutes) goes long before the tiers' TTLs (a day): its
    manifest from every tier, its latest sequence, and its chunks."""
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)],
                          local_ttl_s=86400, ttl_s=7 * 86400) as s:
        manifests = ManifestStore(s)
        now = time.time()
        short = await _save(s, manifests, _retained("short", 600.0, now))
        kept = await _save(s, manifests, _retained("kept", 86400.0, now))
        assert (await manifests.get_manifest(TENANT, "short")) == short
        assert await sweep_retention(manifests, manifests.retention, now + 60) == 0
        removed = await sweep_retention(manifests, manifests.retention, now + 601)
        # its manifest (below DRAM: on SSD) and each chunk in both tiers
        assert removed == 1 + 2 * len(short.chunk_keys())
        assert await manifests.get_manifest(TENANT, "short") is None
        assert manifests.latest(TENANT, "short") is None
        assert not any([await _held(s, k) for k in short.chunk_keys()])
        assert (await manifests.get_manifest(TENANT, "kept")) == kept  # not yet
        assert all([await _held(s, k) for k in kept.chunk_keys()])
        assert s.metrics.value("kvstore_sessions_expired_total") == 1


async def test_chunks_used_since_the_save_stay(tmp_path: Path) -> None:
    """A chunk another session read after this one's save (a shared system prompt) is not
    this session's to drop: it stays under the tiers' own TTLs."""
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)],
                          local_ttl_s=86400, ttl_s=7 * 86400) as s:
        manifests = ManifestStore(s)
        m = await _save(s, manifests, _retained("shared", 60.0, 0.0))
        used = m.chunk_keys()[0]
        assert await s.get(used) is not None  # read now: after the save
        await sweep_retention(manifests, manifests.retention, time.time() + 61)
        assert await manifests.get_manifest(TENANT, "shared") is None
        assert await _held(s, used)
        assert not any([await _held(s, k) for k in m.chunk_keys()[1:]])


async def test_a_newer_turn_resets_the_clock_and_a_turn_without_retention_ends_it(
        tmp_path: Path) -> None:
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)]) as s:
        manifests = ManifestStore(s)
        now = time.time()
        await _save(s, manifests, _retained("t", 60.0, now - 100))
        await _save(s, manifests, _retained("t", 60.0, now))  # the next turn
        assert await sweep_retention(manifests, manifests.retention, now + 30) == 0
        await _save(s, manifests, _retained("t", 0.0, now + 1))
        assert await sweep_retention(manifests, manifests.retention, now + 3600) == 0
        assert await manifests.get_manifest(TENANT, "t") is not None


async def test_a_longer_retention_outlives_the_local_idle_ttl(tmp_path: Path) -> None:
    """The local tiers sweep idle entries after local_ttl_s; a "24h" session's stay while
    it runs, a session without one goes as before."""
    retention = RetentionIndex(max_retain_s=7 * 86400.0)
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)],
                          local_ttl_s=10, ttl_s=7 * 86400,
                          retained=retention.kept_keys) as s:
        manifests = ManifestStore(s, retention=retention)
        now = time.time()
        long = await _save(s, manifests, _retained("long", 3600.0, now))
        plain = await _save(s, manifests, _retained("plain", 0.0, now))
        await s.sweep(now=now + 60)  # both idle past local_ttl_s
        dram = s.dram
        assert all([await dram.contains("c/" + k) for k in long.chunk_keys()])
        assert await s.tiers[1].contains(manifest_tier_key(long.key))
        assert not any([await dram.contains("c/" + k) for k in plain.chunk_keys()])
        await s.sweep(now=now + 3601)  # its retention over: the idle TTL applies again
        assert not any([await dram.contains("c/" + k) for k in long.chunk_keys()])


async def test_a_session_saving_when_it_expires_waits_for_the_next_pass(
        tmp_path: Path) -> None:
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20)]) as s:
        manifests = ManifestStore(s)
        await _save(s, manifests, _retained("busy", 10.0, 0.0))
        assert manifests.latest(TENANT, "busy") is not None
        with manifests.saves.saving(SessionKey(TENANT, "busy")):
            assert await sweep_retention(manifests, manifests.retention,
                                         time.time() + 20) == 0
        assert manifests.latest(TENANT, "busy") is not None
        assert await sweep_retention(manifests, manifests.retention, time.time() + 20) > 0
        assert manifests.latest(TENANT, "busy") is None
