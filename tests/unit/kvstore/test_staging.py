"""A lookup that arrives while its session's staging for an advisory runs waits for it, within a
budget, instead of fetching the same chunks alongside it."""

from __future__ import annotations

import asyncio

from services.kvstore.peers.pull import PullResult
from services.kvstore.staging import SessionStager


async def test_a_lookup_joins_the_running_staging_within_its_budget() -> None:
    stager = SessionStager()
    release = asyncio.Event()

    async def staging() -> PullResult:
        await release.wait()
        return PullResult(True, chunks=4)

    running = asyncio.create_task(stager.run("t", "s", staging()))
    await asyncio.sleep(0)
    assert await stager.join("t", "other", 1.0)  # nothing runs for that session
    assert not await stager.join("t", "s", 0.05)  # still running past the budget
    asyncio.get_running_loop().call_later(0.05, release.set)
    assert await stager.join("t", "s", 5.0)  # landed while waited for
    assert (await running).chunks == 4
    assert await stager.join("t", "s", 0.0)  # (done: forgotten)


async def test_a_failed_staging_does_not_fail_the_lookup() -> None:
    stager = SessionStager()

    async def broken() -> PullResult:
        await asyncio.sleep(0.01)
        raise RuntimeError("peer vanished")

    running = asyncio.create_task(stager.run("t", "s", broken()))
    await asyncio.sleep(0)
    assert await stager.join("t", "s", 1.0)
    assert isinstance((await asyncio.gather(running, return_exceptions=True))[0], RuntimeError)


async def test_a_cancelled_staging_does_not_cancel_the_lookup() -> None:
    stager = SessionStager()

    async def slow() -> PullResult:
        await asyncio.sleep(10)
        return PullResult(True)

    running = asyncio.create_task(stager.run("t", "s", slow()))
    await asyncio.sleep(0)
    joiner = asyncio.create_task(stager.join("t", "s", 5.0))
    await asyncio.sleep(0.01)
    running.cancel()  # (an invalidation, the nodemgr's deadline)
    assert await joiner is True  # the lookup goes on


async def test_a_lookup_streaming_from_the_staging_s_own_peer_stops_it() -> None:
    """The request streams from that peer itself, into its blocks under its forward pass:
    faster than waiting for the DRAM copy, and the two would compete for the peer."""
    stager = SessionStager()

    async def slow() -> PullResult:
        await asyncio.sleep(10)
        return PullResult(True)

    running = asyncio.create_task(stager.run("t", "s", slow(), peer="node0:7000"))
    await asyncio.sleep(0)
    assert not stager.stop_pull_from("t", "s", "")  # no peer named: it joins instead
    assert not stager.stop_pull_from("t", "s", "node9:7000")  # another peer
    assert stager.stop_pull_from("t", "s", "node0:7000")
    result = await running  # ended, not failed: the PrefetchSession call answers
    assert not result.found and "stopped" in result.detail
    assert await stager.join("t", "s", 0.0)  # forgotten
