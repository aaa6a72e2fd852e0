"""A session's KV pulled from a peer kvstore (real gRPC FindPrefix on loopback, the real
TCP chunk stream, real shm pools): straight into the loading node's blocks, after the
peer's save in flight has landed; a corrupt chunk, a trimmed plan, a dead peer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LoadRequest, LookupRequest
from services.kvstore.manifests import ManifestStore
from services.kvstore.peers.data_plane import ChunkServer
from services.kvstore.service import KVStoreService
from services.kvstore.staging import stage_session
from services.kvstore.store.checksum_work import sealed
from shared.chunk_codec import chunk_key
from shared.grpc_server import serve_grpc
from shared.kv_layout import StoredPrefix
from shared.proto import kvstore_pb2_grpc as pb_grpc
from tests.unit.kvstore.engine_path.paths import DST, SRC, STRIDE, make_store, save
from tests.unit.kvstore.pools import (
    BLOCK,
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


@dataclass
class Node:
    path: EnginePoolPath
    pool: object
    pid: str
    address: str = ""


async def node(stack: AsyncExitStack, tmp: Path, serve: bool, save_delay_s: float = 0.0
               ) -> Node:
    pool = make_pool()
    stack.callback(pool.close)
    store = await stack.enter_async_context(make_store(tmp, ssd=False))
    manifests = await stack.enter_async_context(ManifestStore(store, 1.0))
    path = await stack.enter_async_context(EnginePoolPath(
        store, CHUNK_TOKENS, manifests=manifests, peer_wait_s=5.0, peer_timeout_s=5.0,
        debug_save_delay_s=save_delay_s))
    pid, _ = await path.attach(geometry(pool))
    n = Node(path, pool, pid)
    if serve:
        chunks = ChunkServer(store, path.held_blobs, "127.0.0.1", 0)
        path.data_port = await chunks.start()
        stack.push_async_callback(chunks.close)
        service = KVStoreService(manifests, "a", 4, "", path)
        server = await stack.enter_async_context(serve_grpc(
            "127.0.0.1", 0, register=[lambda s: pb_grpc.add_KVStoreServicer_to_server(service, s)],
            service_names=["overture.v1.KVStore"], grace_s=0.1))
        n.address = f"127.0.0.1:{server.port}"
    return n


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    async with AsyncExitStack() as stack:
        a = await node(stack, tmp_path / "a", serve=True)
        b = await node(stack, tmp_path / "b", serve=False)
        yield a, b


async def saved(a: Node, n: int, seed: int) -> tuple[bytes, ...]:
    """``a`` saves a session of ``n`` blocks of random KV; its block hashes."""
    hs = hashes(n)
    fill(a.pool, ids(0, n, SRC, STRIDE), seed=seed)
    await save(a.path, a.pid, hs)
    return hs


async def ask(b: Node, hs: tuple[bytes, ...], peer: str, wait_tokens: int = 0,
              first: int = 0) -> StoredPrefix:
    return await b.path.lookup(LookupRequest(TENANT, "sess", MODEL, hs, first, LAYERS, peer,
                                             wait_tokens))


async def pull(b: Node, r: StoredPrefix, spans: slice = slice(None)) -> list:
    chosen = tuple(r.spans[spans])
    first, n = chosen[0].first_block, sum(s.use_blocks for s in chosen)
    req = LoadRequest(b.pid, r.lease_id, TENANT, MODEL, chosen,
                      tuple(ids(first, n, DST, STRIDE)), LAYERS)
    return [(m.layer, m.ok) async for m in b.path.load(req)]


def same_blocks(a: Node, b: Node, first: int, n: int, layers: range = range(LAYERS)) -> bool:
    for layer in layers:
        src = [SRC + layer * STRIDE + i for i in range(first, first + n)]
        dst = [DST + layer * STRIDE + i for i in range(first, first + n)]
        if not bool((a.pool.kv_cache[src] == b.pool.kv_cache[dst]).all()):
            return False
    return True


async def test_the_peer_s_prefix_lands_in_this_node_s_blocks(pair: tuple[Node, Node]) -> None:
    a, b = pair
    hs = await saved(a, 40, seed=3)
    r = await ask(b, hs, a.address)
    assert r.matched_blocks == 40 and [s.tier for s in r.spans] == ["peer"] * 3
    assert r.tier_bytes_per_s["peer"] > 0  # the planner's rate for the link
    assert await pull(b, r) == [(layer, True) for layer in range(LAYERS)]
    assert same_blocks(a, b, 0, 40)
    m = b.path.store.metrics
    assert m.value("kvstore_peer_bytes_pulled_total", peer=a.address) > 0
    assert m.value("kvstore_peer_lookups_total", result="hit") == 1
    # The chunks are remembered as pulled: this node's save of the turn keeps them here.
    key = chunk_key(TENANT, MODEL, hs[15], 0)
    assert key in b.path.pulled
    assert len(a.path.leases) == 0 or await _leases_end(a)


async def _leases_end(a: Node) -> bool:
    for _ in range(100):  # the pulling node releases the peer's lease in the background
        if len(a.path.leases) == 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_the_peer_waits_for_its_save_in_flight(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        a = await node(stack, tmp_path / "a", serve=True, save_delay_s=0.4)
        b = await node(stack, tmp_path / "b", serve=False)
        hs = hashes(40)
        fill(a.pool, ids(0, 40, SRC, STRIDE), seed=4)
        saving = asyncio.create_task(save(a.path, a.pid, hs))  # lands 0.4 s from now
        await asyncio.sleep(0.05)
        # The turn had 40 blocks and 3 tokens: the asker waits for that much to be saved.
        r = await ask(b, hs, a.address, wait_tokens=40 * BLOCK + 3)
        await saving
        assert r.matched_blocks == 40, "the peer answered before its save landed"
        assert await pull(b, r) == [(layer, True) for layer in range(LAYERS)]
        assert same_blocks(a, b, 0, 40)
        waited = a.path.store.metrics.value("kvstore_peer_save_wait_seconds_sum")
        assert 0.2 < waited < 5.0


async def test_an_advisory_s_staging_waits_for_the_turn_s_save(tmp_path: Path) -> None:
    """An advisory sent the moment a turn ends (its save still running on the node that
    served it) stages the whole turn, from the peer or from this node's own save."""
    async with AsyncExitStack() as stack:
        a = await node(stack, tmp_path / "a", serve=True, save_delay_s=0.4)
        b = await node(stack, tmp_path / "b", serve=False, save_delay_s=0.4)
        hs = hashes(40)
        fill(a.pool, ids(0, 40, SRC, STRIDE), seed=5)
        saving = asyncio.create_task(save(a.path, a.pid, hs))  # lands 0.4 s from now
        await asyncio.sleep(0.05)
        turn = 40 * BLOCK + 4  # (the save records the tokens with KV: all but the last)
        r = await stage_session(b.path.manifests, TENANT, "sess", a.address,
                                wait_tokens=turn, model_fp=MODEL)
        await saving
        assert r.found and r.chunks == 3 * LAYERS and not r.missing, r
        # Without the turn's length the peer answers at once, with what it has.
        r = await stage_session(b.path.manifests, TENANT, "other", a.address, model_fp=MODEL)
        assert not r.found
        # Served here: this node's own save in flight is waited for the same way.
        fill(b.pool, ids(0, 40, SRC, STRIDE), seed=6)
        saving = asyncio.create_task(save(b.path, b.pid, hs, session="here"))
        await asyncio.sleep(0.05)
        r = await stage_session(b.path.manifests, TENANT, "here", wait_tokens=turn,
                                model_fp=MODEL)
        await saving
        assert r.found and not r.missing, r


async def test_a_corrupt_chunk_fails_its_layer_and_every_later_one(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    hs = await saved(a, 20, seed=5)
    key = chunk_key(TENANT, MODEL, hs[15], 1)  # layer 1 of the first chunk
    blob = a.path.store.dram_blob(key)
    assert isinstance(blob, bytearray)
    await sealed(blob)  # (its checksum is computed once, before it leaves)
    blob[-5] ^= 0xFF  # one payload byte, then: a bit flipped in memory or on the wire
    r = await ask(b, hs, a.address)
    assert await pull(b, r) == [(0, True), (1, False)]
    assert b.path.store.metrics.value("kvstore_checksum_failures_total", tier="peer") == 1


async def test_a_trimmed_plan_reads_past_the_chunks_it_no_longer_needs(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    hs = await saved(a, 40, seed=6)
    r = await ask(b, hs, a.address)
    # The device held the first chunk after all: the load asks for the other two only.
    assert await pull(b, r, slice(1, None)) == [(layer, True) for layer in range(LAYERS)]
    assert same_blocks(a, b, 16, 24)


async def test_an_unreachable_peer_means_nothing_found_here(pair: tuple[Node, Node]) -> None:
    _, b = pair
    b.path.peer_timeout_s = 1.0
    r = await ask(b, hashes(20), "127.0.0.1:1")
    assert r.matched_blocks == 0 and not r.spans and not r.lease_id
    assert b.path.store.metrics.value("kvstore_peer_lookups_total", result="error") == 1


async def test_the_local_copy_comes_first_and_the_peer_adds_the_rest(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    hs = await saved(a, 40, seed=7)
    # b holds the first 16 blocks itself (an earlier turn served here).
    first = ids(0, 16, SRC, STRIDE)
    b.pool.kv_cache[first] = a.pool.kv_cache[first]
    await save(b.path, b.pid, hs[:16])
    r = await ask(b, hs, a.address)
    assert [(s.tier, s.first_block) for s in r.spans] == [("dram", 0), ("peer", 16),
                                                           ("peer", 32)]
    assert await pull(b, r) == [(layer, True) for layer in range(LAYERS)]
    assert same_blocks(a, b, 0, 40)


async def test_layers_read_ahead_still_come_off_the_stream_in_order(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    b.path.readahead_layers = 3  # several layer reads in flight: each waits for its turn
    hs = await saved(a, 40, seed=8)
    r = await ask(b, hs, a.address)
    assert await pull(b, r) == [(layer, True) for layer in range(LAYERS)]
    assert same_blocks(a, b, 0, 40)


async def test_a_pull_stopped_before_its_load_fails_the_load_cleanly(
    pair: tuple[Node, Node],
) -> None:
    a, b = pair
    hs = await saved(a, 20, seed=9)
    r = await ask(b, hs, a.address)
    lease = b.path.leases.get(r.lease_id)
    assert lease is not None and lease.fetch is not None
    lease.fetch.close()  # as an expiring lease would
    assert await pull(b, r) == [(0, False)]
