"""What the store does with a forged or swapped object in a tier below DRAM (issue 43):
it is corrupt, counted in ``kvstore_checksum_failures_total``, deleted, and a miss, so
the engine recomputes; never another session's or a forger's KV."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.harness import CLUSTER_SECRET
from services.kvstore.manifests import ManifestStore
from services.kvstore.store.keys import manifest_tier_key
from services.kvstore.tiers import DramTier, SsdTier
from shared import internal_auth
from shared.chunk_codec import seal_chunk
from tests.unit.kvstore.chunks import kv_tensor, meta, session_manifest
from tests.unit.kvstore.stores import make_store
from tests.unit.kvstore.tier_faults import overwrite


async def test_a_chunk_swapped_between_sessions_is_corrupt_not_served(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 1 << 20)
    async with make_store([DramTier(1 << 20), ssd]) as s:
        a = await s.put(meta("session-a", 0, 0), kv_tensor(1))
        b = await s.put(meta("session-b", 0, 0), kv_tensor(2))
        await a.durable
        await b.durable
        await s.dram.delete("c/" + b.key)
        await overwrite(ssd, "c/" + b.key, bytes(await ssd.get("c/" + a.key)))
        assert await s.get(b.key) is None  # not session a's KV
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
        assert not await ssd.contains("c/" + b.key)
        found = await s.get(a.key)
        assert found is not None and torch.equal(found.tensor, kv_tensor(1))


async def test_a_chunk_forged_without_the_cluster_key_is_corrupt(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 1 << 20)
    async with make_store([DramTier(1 << 20), ssd]) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(3))
        await r.durable
        await s.dram.delete("c/" + r.key)
        forged = bytearray(await ssd.get("c/" + r.key))
        forged[-4:] = b"\0\0\x80\x7f"  # an inf in the KV
        forged[6:8] = b"\0\0"
        internal_auth.configure("an-attackers-own-secret")
        try:
            seal_chunk(forged)
        finally:
            internal_auth.configure(CLUSTER_SECRET)
        await overwrite(ssd, "c/" + r.key, bytes(forged))
        assert await s.get(r.key) is None
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1


async def test_a_manifest_swapped_between_sessions_is_refused(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "db"), 1 << 20)
    async with make_store([DramTier(1 << 20), ssd]) as s:
        ms = ManifestStore(s)
        a, b = session_manifest("a", 3, 2, 2), session_manifest("b", 5, 2, 2)
        await ms.write_manifest(a)
        await ms.write_manifest(b)
        assert await ms.get_manifest(a.tenant, "b") == b
        await overwrite(ssd, manifest_tier_key(b.key),
                        bytes(await ssd.get(manifest_tier_key(a.key))))
        assert await ms.get_manifest(a.tenant, "b") is None  # not a's chunks for b
        assert s.metrics.value("kvstore_checksum_failures_total", tier="ssd") == 1
        assert await ms.get_manifest(a.tenant, "a") == a
