"""Requests from clients and peers that would make the kvstore do unbounded work."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from services.kvstore import service as service_mod
from services.kvstore.manifests import ManifestStore
from services.kvstore.manifests.manifest import (
    MANIFEST_HEAD,
    MAX_MANIFEST_CHUNKS,
    Manifest,
    sealed_manifest,
)
from services.kvstore.service import KVStoreService
from shared.chunk_codec import ChunkFormatError
from shared.proto import kvstore_pb2 as pb
from tests.unit.kvstore.chunks import session_chunks, session_manifest


def test_a_manifest_naming_too_many_chunks_is_refused() -> None:
    """Every chunk a manifest names is checked before it is written: one block hash with
    a million layers took ~28 s of the server's loop before this bound."""
    m = session_manifest("s", 1, 1, 1)
    with pytest.raises(ChunkFormatError, match="at most"):
        dataclasses.replace(m, num_layers=10**6)
    too_long = session_manifest("s", MAX_MANIFEST_CHUNKS // 4, 4, 1)  # at the bound ...
    with pytest.raises(ChunkFormatError, match="at most"):
        dataclasses.replace(too_long, num_layers=5)  # ... one more layer is over


@pytest.mark.parametrize("hashes", [[12345], [b""], [b"x" * 65]])
def test_a_stored_manifest_with_malformed_hashes_is_unreadable(hashes: list) -> None:
    """``bytes(12345)`` would have been 12345 zero bytes; it is a format error instead."""
    m = session_manifest("s", 2, 1, 1)
    data = msgpack.unpackb(m.encode()[MANIFEST_HEAD:])
    data["hashes"] = hashes
    with pytest.raises(ChunkFormatError):  # (sealed: only the hashes are wrong)
        Manifest.decode(sealed_manifest(m.key, msgpack.packb(data)), m.key)


async def test_get_chunks_caps_the_clients_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk read ahead is a blob in memory: a client may ask for less read-ahead
    than kvstore.stream_window, never more."""
    seen: list[int] = []

    async def fake_stream(store, manifest, first, last, window):
        seen.append(window)
        return
        yield

    class Store:
        store = None

        async def newest_manifest(self, tenant, session_id):
            return session_manifest("s", 2, 1, 1)

    monkeypatch.setattr(service_mod, "stream_session", fake_stream)
    svc = KVStoreService(Store(), "n", 4, "", pool_path=None)
    ref = pb.ManifestRef(tenant="t1", session_id="s")
    for asked in (0, 2, 100000):
        [m async for m in svc.GetChunks(pb.GetChunksRequest(session=ref, window=asked), None)]
    assert seen == [4, 2, 4]


class Aborted(Exception):
    pass


class FakeContext:
    """The servicer context's abort (raises, as grpc's does) and nothing else."""

    def __init__(self) -> None:
        self.code = None

    async def abort(self, code, details: str = "") -> None:
        self.code = code
        raise Aborted(f"{code}: {details}")


def test_layers_in_keys_are_parsed_safely() -> None:
    from services.kvstore.service import _layer_of

    assert _layer_of("t/m/h/7") == 7
    for key in ("t/m/h/\u00b2", "t/m/h/4294967296", "t/m/h/", "nothing"):
        assert _layer_of(key) == 0  # named no layer: reported with layer 0, never a crash


def test_manifests_and_names_are_bounded() -> None:
    m = session_manifest("s", 4, 1, 1)
    for bad in ({"num_layers": 65536}, {"session_id": "x" * 300}, {"tenant": "t" * 300},
                {"model_fp": "a/b"}):
        with pytest.raises(ChunkFormatError):
            dataclasses.replace(m, **bad)


async def test_a_manifest_of_unknown_chunks_stops_at_the_first_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest naming 2^18 chunks this store never saw costs one batch of checks."""
    from services.kvstore.errors import ManifestIncomplete
    from services.kvstore.manifests.manifest_store import DURABLE_CHECK_BATCH
    from services.kvstore.metrics import KVStoreMetrics
    from services.kvstore.store import TieredStore
    from services.kvstore.tiers import DramTier

    async with TieredStore([DramTier(1 << 20)], KVStoreMetrics()) as st:
        asked = []
        real = st.ledger.durable_for_a_ttl

        async def counting(key: str):
            asked.append(key)
            return await real(key)

        monkeypatch.setattr(st.ledger, "durable_for_a_ttl", counting)
        big = session_manifest("s", MAX_MANIFEST_CHUNKS // 1024, 1024, 1)
        with pytest.raises(ManifestIncomplete):
            await ManifestStore(st).put_manifest(big)
        assert len(asked) == DURABLE_CHECK_BATCH


async def test_service_bounds_and_checks_requests_before_acting() -> None:
    from services.kvstore.engine_path.data_path import EnginePoolPath
    from services.kvstore.metrics import KVStoreMetrics
    from services.kvstore.service import MAX_KEYS_PER_CALL, MAX_REJECTED_PER_CALL
    from services.kvstore.store import TieredStore
    from services.kvstore.tiers import DramTier

    async with TieredStore([DramTier(1 << 22)], KVStoreMetrics()) as st, \
            EnginePoolPath(st, 256) as dp:
        svc = KVStoreService(dp.manifests, "n", 4, "", dp)
        too_many = [f"t/m/h/{i}" for i in range(MAX_KEYS_PER_CALL + 1)]

        async def drain(stream) -> list:
            return [m async for m in stream]

        for call in (
            lambda ctx: drain(svc.GetChunks(pb.GetChunksRequest(keys=too_many), ctx)),
            lambda ctx: svc.Stat(pb.StatRequest(keys=too_many), ctx),
            lambda ctx: svc.Delete(pb.DeleteRequest(keys=too_many), ctx),
            lambda ctx: svc.Delete(pb.DeleteRequest(session=pb.ManifestRef(
                tenant="t1", session_id="s" * 10000)), ctx),
            lambda ctx: svc.FencePoolOp(pb.FencePoolOpRequest(op_id="o" * 10000), ctx),
        ):
            ctx = FakeContext()
            with pytest.raises(Aborted, match="INVALID_ARGUMENT"):
                await call(ctx)
        assert not dp.manifests._forgotten and not dp.ops._ended  # nothing remembered of them

        m = session_manifest("s", 2, 3, 1)
        for cm, t in session_chunks(m):
            await st.put(cm, t)
        await dp.manifests.put_manifest(m)
        ref = pb.ManifestRef(tenant=m.tenant, session_id="s")
        for first, last in ((3, None), (2, 1), (0, 3)):
            req = pb.GetChunksRequest(session=ref, first_layer=first)
            if last is not None:
                req.last_layer, req.has_last_layer = last, True
            with pytest.raises(Aborted, match="not within"):
                await drain(svc.GetChunks(req, FakeContext()))

        async def garbage():
            for _ in range(MAX_REJECTED_PER_CALL + 5):
                yield pb.ChunkData(key="k", blob=b"junk")

        with pytest.raises(Aborted, match="malformed chunks"):
            await svc.PutChunks(garbage(), FakeContext())
