"""Requests from clients and peers that would make the kvstore do unbounded work."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from services.kvstore import service as service_mod
from services.kvstore.manifest import MAX_MANIFEST_CHUNKS, Manifest
from services.kvstore.service import KVStoreService
from shared.chunk_codec import ChunkFormatError
from shared.proto import kvstore_pb2 as pb
from tests.unit.kvstore.chunks import session_manifest


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
    data = msgpack.unpackb(session_manifest("s", 2, 1, 1).encode())
    data["hashes"] = hashes
    with pytest.raises(ChunkFormatError):
        Manifest.decode(msgpack.packb(data))


async def test_get_chunks_caps_the_clients_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk read ahead is a blob in memory: a client may ask for less read-ahead
    than kvstore.stream_window, never more."""
    seen: list[int] = []

    async def fake_stream(store, manifest, first, last, window):
        seen.append(window)
        return
        yield

    class Store:
        async def get_manifest(self, tenant, session_id):
            return session_manifest("s", 2, 1, 1)

    monkeypatch.setattr(service_mod, "stream_session", fake_stream)
    svc = KVStoreService(Store(), "n", 4, "", pool_path=None)
    ref = pb.ManifestRef(tenant="t1", session_id="s")
    for asked in (0, 2, 100000):
        [m async for m in svc.GetChunks(pb.GetChunksRequest(session=ref, window=asked), None)]
    assert seen == [4, 2, 4]
