"""Pulling a session from a peer that misbehaves: stalls, short streams, bad data.

The peer is a scripted KVStore servicer on loopback; the pulling side is the real store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from services.kvstore.errors import TierUnavailable
from services.kvstore.manifests import ManifestStore
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.peers.pull import pull_session
from services.kvstore.store import TieredStore
from services.kvstore.tiers import DramTier
from services.kvstore.wire import manifest_to_pb
from shared.chunk_codec import ChunkFormatError, encode_chunk
from shared.grpc_server import serve_grpc
from shared.proto import kvstore_pb2 as pb
from shared.proto import kvstore_pb2_grpc as pb_grpc
from tests.unit.kvstore.chunks import TENANT, session_chunks, session_manifest

MANIFEST = session_manifest("s", 4, 2, 1)  # 4 chunks per layer, 2 layers
BLOBS = [(cm.key, bytes(encode_chunk(cm, t))) for cm, t in session_chunks(MANIFEST)]


class ScriptedPeer(pb_grpc.KVStoreServicer):
    """Serves MANIFEST; ``stop_at``: the chunk index where ``mode`` ("hang", "end") acts."""

    def __init__(
        self, mode: str = "", stop_at: int = 2, manifest: pb.SessionManifest | None = None
    ):
        self.mode, self.stop_at = mode, stop_at
        self.manifest = manifest_to_pb(MANIFEST) if manifest is None else manifest

    async def GetManifest(self, request, context):
        if self.mode == "hang_manifest":
            await asyncio.sleep(3600)
        return pb.ManifestReply(found=True, manifest=self.manifest)

    async def GetChunks(self, request, context):
        for i, (key, blob) in enumerate(BLOBS):
            if i == self.stop_at and self.mode == "hang":
                await asyncio.sleep(3600)
            if i == self.stop_at and self.mode == "end":
                return  # a clean end before the manifest's last chunk
            yield pb.ChunkData(key=key, blob=blob, found=True)


@contextlib.asynccontextmanager
async def peer(servicer: ScriptedPeer) -> AsyncIterator[str]:
    register = [lambda s: pb_grpc.add_KVStoreServicer_to_server(servicer, s)]
    async with serve_grpc("127.0.0.1", 0, register=register, service_names=[]) as srv:
        yield f"127.0.0.1:{srv.port}"


def store() -> TieredStore:
    return TieredStore([DramTier(1 << 24)], KVStoreMetrics())


async def test_a_whole_session_arrives_with_nothing_missing() -> None:
    async with peer(ScriptedPeer()) as addr, store() as st:
        r = await pull_session(ManifestStore(st), addr, TENANT, "s", timeout_s=5)
        assert (r.found, r.chunks, r.missing) == (True, len(BLOBS), 0)


async def test_a_stream_that_ends_early_counts_what_it_did_not_deliver() -> None:
    async with peer(ScriptedPeer("end", stop_at=3)) as addr, store() as st:
        r = await pull_session(
            ManifestStore(st), addr, TENANT, "s", write_manifest=True, timeout_s=5
        )
        assert (r.chunks, r.missing) == (3, len(BLOBS) - 3)
        assert (
            await ManifestStore(st).get_manifest(TENANT, "s") is None
        )  # never written with chunks missing


async def test_a_peer_that_stalls_mid_stream_is_unavailable_not_a_hang() -> None:
    async with peer(ScriptedPeer("hang")) as addr, store() as st:
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable, match="no chunk for"):
            await pull_session(ManifestStore(st), addr, TENANT, "s", timeout_s=0.3)
        assert time.monotonic() - t0 < 5
        assert st.stats()[0].entries == 2  # what arrived before the stall is kept


async def test_a_peer_that_never_answers_the_manifest_is_unavailable() -> None:
    async with peer(ScriptedPeer("hang_manifest")) as addr, store() as st:
        with pytest.raises(TierUnavailable, match="DEADLINE_EXCEEDED"):
            await pull_session(ManifestStore(st), addr, TENANT, "s", timeout_s=0.3)


async def test_a_manifest_of_another_session_or_malformed_is_refused() -> None:
    other = manifest_to_pb(session_manifest("other", 4, 2, 1))
    bad = manifest_to_pb(MANIFEST)
    bad.num_layers = 0
    for m, why in ((other, "another session"), (bad, "malformed")):
        async with peer(ScriptedPeer(manifest=m)) as addr, store() as st:
            with pytest.raises(TierUnavailable, match=why):
                await pull_session(ManifestStore(st), addr, TENANT, "s", timeout_s=5)


async def test_a_bad_session_reference_is_the_callers_error() -> None:
    async with store() as st:
        with pytest.raises(ChunkFormatError):
            await pull_session(ManifestStore(st), "127.0.0.1:1", TENANT, "a/b", timeout_s=0.3)
