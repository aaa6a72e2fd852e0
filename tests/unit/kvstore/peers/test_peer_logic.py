"""The logic around peer pulls without a second node: waiting for a save in flight, the
checks on a peer's answer, the chunk server's refusal of bad requests, and saves that do
not write a peer's chunks to the shared tier again."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack

from services.kvstore.engine_path.types import FindRequest, PeerChunk
from services.kvstore.manifests.save_waits import SaveWaits
from services.kvstore.peers.data_plane import LEN, MISSING, ChunkServer, request_bytes
from services.kvstore.peers.find import _matching
from services.kvstore.peers.links import PeerLinks, PulledKeys
from services.kvstore.tiers import DramTier
from shared.chunk_codec import ChunkMeta
from tests.unit.kvstore.chunks import kv_tensor
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.pools import hashes
from tests.unit.kvstore.stores import make_store

SID = ("t", "s")


async def test_a_wait_ends_when_a_long_enough_save_lands() -> None:
    w = SaveWaits()
    assert w.settled(SID, 0) and not w.settled(SID, 10)

    async def save_later() -> None:
        with w.saving(SID):
            await asyncio.sleep(0.05)
        w.saved(SID, 12)

    task = asyncio.create_task(save_later())
    waited = await w.wait(SID, 10, 5.0)
    await task
    assert 0.03 < waited < 1.0 and w.settled(SID, 10)


async def test_a_wait_is_bounded_and_a_running_save_is_waited_for() -> None:
    w = SaveWaits()
    w.saved(SID, 100)
    with w.saving(SID):  # a newer save under way: not settled, however long the last one
        assert not w.settled(SID, 50)
        assert 0.05 <= await w.wait(SID, 50, 0.05) < 1.0
    assert w.settled(SID, 50)
    w.forget(SID)
    assert not w.settled(SID, 50)
    assert not w._changed and not w._waiters  # nothing kept for sessions nobody awaits


async def test_a_turn_s_length_is_read_as_what_its_save_records() -> None:
    """The scheduler knows a turn as prompt + completion tokens; the engine saves the
    tokens that have KV (all but the last) in whole blocks."""
    w = SaveWaits()
    assert w.turn_saved(SID, 100) == 99  # no save yet: the block size is unknown
    w.saved(SID, 96, block_size=16)  # the save of a 100-token turn: 6 blocks
    assert w.turn_saved(SID, 100) == 96 and w.turn_saved(SID, 0) == 0
    assert await w.wait(SID, 100, 1.0, turn=True) < 0.5  # settled: no wait
    assert not w.settled(SID, w.turn_saved(SID, 130))  # a longer turn: not yet saved
    w.forget(SID)
    assert w.turn_saved(SID, 100) == 99


def test_a_peer_s_chunks_are_used_only_while_they_match_the_prompt() -> None:
    prompt = hashes(40)
    req = FindRequest("t", "s", "m", prompt, 0, 2, 16)
    good = [PeerChunk(prompt[0:16], 0, 16, "dram"), PeerChunk(prompt[16:32], 16, 16, "dram")]
    assert _matching(tuple(good), req) == tuple(good)
    other = hashes(40, tag="x")
    bad = [good[0], PeerChunk(other[16:32], 16, 16, "dram"),
           PeerChunk(prompt[32:40], 32, 8, "dram")]
    assert _matching(tuple(bad), req) == (good[0],)
    gap = [good[0], PeerChunk(prompt[32:40], 32, 8, "dram")]
    assert _matching(tuple(gap), req) == (good[0],)
    too_long = [PeerChunk(prompt[0:17], 0, 17, "dram")]
    assert _matching(tuple(too_long), req) == ()
    # A chunk starting mid-grid serves only blocks that agree with the prompt.
    later = FindRequest("t", "s", "m", prompt, 20, 2, 16)
    assert _matching((PeerChunk(prompt[16:32], 20, 12, "ssd"),), later) != ()
    assert _matching((PeerChunk(prompt[16:32], 20, 13, "ssd"),), later) == ()


def test_link_bandwidth_starts_at_the_prior_and_follows_measurements() -> None:
    links = PeerLinks(1e8)
    assert links.bytes_per_s("a:1") == 1e8
    links.observe("a:1", 32 << 10, 0.001)  # a tiny pull measures round trips: ignored
    links.observe("a:1", 100 << 20, 0.5)
    assert abs(links.bytes_per_s("a:1") - (100 << 20) / 0.5) < 1
    keys = PulledKeys(capacity=2)
    keys.add([["a", "b"], ["c"]])
    assert "a" not in keys and "b" in keys and "c" in keys


async def test_the_chunk_server_answers_missing_keys_and_drops_bad_requests() -> None:
    async with make_store([DramTier(1 << 24)]) as store:
        server = ChunkServer(store, lambda lease: {}, "127.0.0.1", 0)
        port = await server.start()
        loop = asyncio.get_running_loop()
        try:
            for bad in (b"\xff\xff\xff\x7f", LEN.pack(3) + b"abc", LEN.pack(1) + b"\x05",
                        LEN.pack(9) + msgpack.packb({"v": 2, "keys": []})[:9],
                        request_bytes("", [1, 2])):  # type: ignore[list-item]
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", port))
                await loop.sock_sendall(s, bad)
                assert await asyncio.wait_for(loop.sock_recv(s, 10), 5) == b""  # closed
                s.close()
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, request_bytes("", ["t/m/00/0", "t/m/01/1"]))
            got = b""
            while len(got) < 8:
                got += await loop.sock_recv(s, 8 - len(got))
            assert struct.unpack("<II", got) == (MISSING, MISSING)
            s.close()
        finally:
            await server.close()


async def test_a_saved_copy_of_a_peer_s_chunk_skips_the_shared_tier() -> None:
    remote = FlakyTier()
    remote.name = "s3"  # the lowest tier every node shares
    async with make_store([DramTier(1 << 24), DramTier(1 << 24), remote]) as store:
        store.tiers[1].name = "ssd"
        assert store.lowest_shared
        own = ChunkMeta("t", "m", 0, hashes(2, "own"))
        copy = ChunkMeta("t", "m", 0, hashes(2, "copy"))
        from shared.chunk_codec import encode_chunk

        await store.put_encoded(own, encode_chunk(own, kv_tensor(2), seal=False)).durable
        await store.put_encoded(copy, encode_chunk(copy, kv_tensor(2), seal=False),
                                copy_of_shared=True).durable
        await store.writer.wait_idle(5.0)
        assert remote.puts == 1
        assert store.tiers[1].has_local("c/" + copy.key)
