"""The kvstore lists the sessions it holds on its own tiers, a page at a time, across its
own restart: what a restarted scheduler's session directory is rebuilt from (issue 43)."""

from __future__ import annotations

from pathlib import Path

from services.kvstore.manifests import ManifestStore
from services.kvstore.manifests.latest import SavedSequence
from services.kvstore.manifests.listing import list_sessions
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.tiers import DramTier, SsdTier
from shared.session_key import SessionKey
from tests.unit.kvstore.chunks import MODEL, TENANT, session_chunks, session_manifest
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.stores import make_store


class SharedTier(FlakyTier):
    name = "s3"  # every node reads it: what is only there is no reason to route here


async def test_sessions_on_the_nodes_own_tiers_are_listed_in_pages(tmp_path: Path) -> None:
    shared = SharedTier()
    sessions = {"a": 3, "b": 5, "c": 2}
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20),
                           shared]) as s:
        ms = ManifestStore(s)
        for name, blocks in sessions.items():
            m = session_manifest(scoped_session(name, MODEL), blocks, 2, 1)
            for cm, t in session_chunks(m):
                await s.put(cm, t)
            await ms.put_manifest(m, wait_s=5)
        # Only in the shared tier (another node saved it): not this node's.
        other = session_manifest(scoped_session("elsewhere", MODEL), 2, 1, 1)
        for cm, t in session_chunks(other):
            await s.put(cm, t)
        await ms.put_manifest(other, wait_s=5)
        for tier in s.tiers[:-1]:
            await tier.delete("m/" + other.key)
    # A restart: nothing remembered in memory, the SSD's manifests are what it holds.
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20),
                           shared]) as s:
        ms = ManifestStore(s)
        first, cursor = await list_sessions(ms, limit=2)
        assert [(x.tenant, x.session_id, x.tokens) for x in first] == [
            (TENANT, "a", 12), (TENANT, "b", 20)]
        assert cursor and all(0 <= x.age_s < 60 for x in first)
        rest, end = await list_sessions(ms, cursor, limit=2)
        assert [(x.session_id, x.tokens) for x in rest] == [("c", 8)] and end == ""
        # A save remembered in memory, before its manifest lands, is listed too.
        newer = session_manifest(scoped_session("d", MODEL), 4, 1, 1)
        ms.sequences.note(SessionKey(TENANT, newer.session_id), SavedSequence(
            MODEL, newer.block_hashes, newer.token_count, 1), newer)
        listed, _ = await list_sessions(ms)
        assert [(x.session_id, x.tokens) for x in listed] == [
            ("a", 12), ("b", 20), ("c", 8), ("d", 16)]
