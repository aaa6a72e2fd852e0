"""The write-behind below DRAM: retries, a full queue, ordering, shutdown with a dead S3."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from services.kvstore.errors import WriteDropped
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import decode_chunk
from tests.unit.kvstore.chunks import (
    kv_tensor,
    meta,
)
from tests.unit.kvstore.flaky import FlakyTier
from tests.unit.kvstore.stores import (
    make_store,
    version,
)


async def test_remote_down_queues_retries_and_falls_back_to_local(tmp_path: Path) -> None:
    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote]) as s:
        r = await s.put(meta("s", 0, 0), kv_tensor(1))
        for _ in range(500):  # the write-behind reaches the SSD (bounded wait)
            if s.tiers[1].has_local("c/" + r.key):
                break
            await asyncio.sleep(0.01)
        assert not r.durable.done()
        assert s.health()[0] is False and "remote degraded" in s.health()[1]
        await s.dram.delete("c/" + r.key)
        assert (await s.get(r.key)) is not None  # SSD serves while the remote is down
        remote.down = False
        await asyncio.wait_for(r.durable, 5)
        assert s.health() == (True, "ok")


async def test_full_queue_drops_lowest_priority_oldest_and_keeps_local_copies() -> None:
    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), remote], write_queue=3, write_workers=1) as s:
        receipts = [
            await s.put(meta("s", i, layer=0), kv_tensor(i), priority=p)
            for i, p in enumerate([5, 1, 5, 1, 5])
        ]
        await asyncio.sleep(0.05)
        dropped = [
            i
            for i, r in enumerate(receipts)
            if r.durable.done() and isinstance(r.durable.exception(), WriteDropped)
        ]
        assert dropped == [1, 3]
        assert s.writer.dropped == 2 and s.metrics.value("kvstore_write_behind_dropped_total") == 2
        for r in receipts:  # every chunk still readable locally
            assert await s.get(r.key) is not None
        remote.down = False
        for i in (0, 2, 4):
            await asyncio.wait_for(receipts[i].durable, 5)
        s.check_integrity()


async def test_closing_with_s3_black_holed_neither_stalls_the_loop_nor_overruns() -> None:
    """An S3 endpoint that accepts connections and never answers: close gives up on the
    write-behind after drain_s, stops the S3 retries, and never blocks the event loop."""
    import socket

    from services.kvstore.config import S3Config
    from services.kvstore.tiers.s3 import S3Tier

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    held: list = []
    stop = threading.Event()

    def accept() -> None:
        hole.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(hole.accept())
            except OSError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        s3 = S3Tier(
            S3Config(
                endpoint_url=f"http://127.0.0.1:{hole.getsockname()[1]}",
                bucket="kv",
                access_key_id="x",
                secret_access_key="x",
                timeout_s=0.5,
                max_attempts=2,
                backoff_s=0.2,
            )
        )
        store = make_store([DramTier(1 << 24), s3], drain_s=0.5)
        await store.__aenter__()
        gaps: list[float] = []

        async def heartbeat() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await store.put(meta("s", 0, 0), kv_tensor(1))
        await asyncio.sleep(0.3)  # the S3 put is now on an S3 thread, waiting
        gaps.clear()
        t0 = time.monotonic()
        await store.__aexit__(None, None, None)
        took = time.monotonic() - t0
        await asyncio.sleep(0.05)
        beat.cancel()
        assert max(gaps) < 0.5, f"event loop stalled {max(gaps):.2f}s"
        assert took < 0.5 + 0.5 + 1.5, f"close took {took:.2f}s"  # drain, one call, slack
    finally:
        stop.set()
        acceptor.join(2)
        for conn, _ in held:
            conn.close()
        hole.close()


async def test_lowest_tier_retries_are_served_under_a_steady_load_of_new_writes() -> None:
    """A short outage leaves chunks waiting for their lowest-tier retry. The tier is back,
    but new saves keep arriving faster than the writer drains: the retries must still get
    their turn instead of waiting until they are the first dropped."""

    class SlowLocal(DramTier):
        name = "ssd"

        async def put(self, key: str, blob, priority: int = 0) -> list[str]:
            await asyncio.sleep(0.005)
            return await super().put(key, blob, priority)

    remote = FlakyTier()
    async with make_store(
        [DramTier(1 << 28), SlowLocal(1 << 28), remote], write_queue=64, write_workers=1
    ) as s:
        remote.down = True
        early = [await s.put(meta("a", i, 0), kv_tensor(i)) for i in range(5)]
        await asyncio.sleep(0.1)  # on the SSD; their lowest-tier write waits for a retry
        remote.down = False
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 1.5:  # about 1.5x what one worker drains
            for _ in range(3):
                await s.put(meta("b", n, 0), kv_tensor(n))
                n += 1
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*(r.durable for r in early)), 5)


async def test_writes_of_one_key_land_in_the_order_they_were_made(tmp_path: Path) -> None:
    """v1's lowest-tier write fails and waits for a retry; v2 is put meanwhile. v1 must
    not land last: every tier ends with v2."""

    remote = FlakyTier()
    remote.down = True
    async with make_store([DramTier(1 << 20), SsdTier(str(tmp_path / "db"), 1 << 20), remote]) as s:
        m = meta("s", 0, 0)
        r1 = await s.put(m, kv_tensor(1))
        await asyncio.sleep(0.03)  # v1 failed on the remote, retrying
        r2 = await s.put(m, kv_tensor(2))
        remote.down = False
        await asyncio.gather(r1.durable, r2.durable, return_exceptions=True)
        await s.writer.wait_idle(5)
        tk = "c/" + m.key
        assert version(decode_chunk(await remote.get(tk)).tensor) == "v2"
        assert version(decode_chunk(await s.tiers[1].get(tk)).tensor) == "v2"
        assert version((await s.get(m.key)).tensor) == "v2"
        s.writer.check_integrity()
