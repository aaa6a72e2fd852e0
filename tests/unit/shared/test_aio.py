"""A retry loop that swallows its own cancellation (as a library reporting it as an error
of its own does) still stops when cancelled; a second server on a taken port fails."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from shared.aio import raise_if_cancel_requested
from shared.grpc_server import serve_grpc


async def test_a_loop_that_swallows_its_cancel_still_stops() -> None:
    async def retry(rounds: int, check: bool) -> int:
        done = 0
        for _ in range(rounds):
            done += 1
            try:
                await asyncio.sleep(0.01 if done > 1 else 10)
            except asyncio.CancelledError:
                pass  # reported as "the call failed", and retried
            if check:
                raise_if_cancel_requested()
        return done

    # Without the check the loop outlives its cancel: every round runs.
    task = asyncio.create_task(retry(5, check=False))
    await asyncio.sleep(0)
    task.cancel()
    assert await asyncio.wait_for(task, 5) == 5
    # With it, the loop stops in the round the cancel came.
    task = asyncio.create_task(retry(5, check=True))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_a_second_grpc_server_on_a_taken_port_fails_to_bind() -> None:
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            serve_grpc("127.0.0.1", 0, register=[], service_names=[], grace_s=0.0))
        with pytest.raises(OSError, match="could not bind"):
            async with serve_grpc("127.0.0.1", first.port, register=[], service_names=[],
                                  grace_s=0.0):
                pass
