"""Issue 43, finding 6: stalled request bodies from key holders cannot pin the scheduler's
memory. A tenant's bodies being read at once share a byte budget (429 beyond it, 413 for
one that could never fit); a stalled body's 408 closes its connection, gives its bytes
back to the budget and hands the freed buffers back to the kernel."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack

import pytest

from services.scheduler.api import ApiError
from services.scheduler.http import BodyBudget
from tests.unit.scheduler.conftest import Clock, call, make_cluster

KEYS = {"key-of-alpha": "alpha", "key-of-beta1": "beta"}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2}


def test_a_tenants_bodies_share_its_budget() -> None:
    trims: list[int] = []
    clock = Clock()
    budget = BodyBudget(per_tenant=100, max_body_bytes=80, trim=lambda: trims.append(1),
                        clock=clock)
    with budget.reading("a", 60):
        assert budget.held("a") == 60
        with pytest.raises(ApiError) as e, budget.reading("a", 50):
            pass
        assert e.value.status == 429 and e.value.code == "too_many_body_bytes"
        assert e.value.headers["Retry-After"] == "1"
        with budget.reading("b", 60):  # another tenant's budget
            pass
        with budget.reading("a", 40):
            assert budget.held("a") == 100
    assert budget.held("a") == 0
    # (no length: counts as max_body_bytes, 80)
    with pytest.raises(ApiError) as e, budget.reading("a", None), budget.reading("a", 30):
        pass
    assert e.value.status == 429 and budget.held("a") == 0
    with pytest.raises(ApiError) as e, BodyBudget(per_tenant=10, max_body_bytes=80
                                                  ).reading("a", 20):
        pass
    assert e.value.status == 413
    with BodyBudget(per_tenant=0, max_body_bytes=80).reading("a", 80):  # (0: no limit)
        pass
    assert budget.stalled() and not budget.stalled() and trims == [1]  # once a second
    clock.now += 1.5
    assert budget.stalled() and trims == [1, 1]


async def _stalled_upload(port: int, key: str, length: int, sent: bytes
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n").encode() + sent)
    await writer.drain()
    return reader, writer


async def test_stalled_bodies_hold_their_tenants_budget_until_their_408() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, api_keys=KEYS, tenant_body_bytes=16 << 10,
                               body_timeout_s=2.0)  # (room for a busy machine)
        state = c.scheduler.state
        trims: list[int] = []
        state.bodies._trim = lambda: trims.append(1)
        port = c.scheduler.http_port
        reader, writer = await _stalled_upload(port, "key-of-alpha", 10_000, b'{"mod')
        while state.bodies.held("alpha") == 0:
            await asyncio.sleep(0.01)
        assert state.bodies.held("alpha") == 10_000
        # A second stalled body of the same tenant does not fit beside it: 429 at once.
        second, w2 = await _stalled_upload(port, "key-of-alpha", 10_000, b"{")
        reply = await asyncio.wait_for(second.read(), 5)
        assert b" 429 " in reply.split(b"\r\n")[0]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == (
            "too_many_body_bytes")
        w2.close()
        # Other tenants upload meanwhile.
        beta = {"Authorization": "Bearer key-of-beta1"}
        assert (await call(c, "POST", "/v1/chat/completions", CHAT, beta))[0] == 200
        # The stalled one gets its 408, and its connection is closed (read() ends).
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert b" 408 " in reply.split(b"\r\n")[0]
        assert state.bodies.held("alpha") == 0 and trims == [1]
        alpha = {"Authorization": "Bearer key-of-alpha"}
        assert (await call(c, "POST", "/v1/chat/completions", CHAT, alpha))[0] == 200
        status, err, _ = await call(c, "POST", "/v1/chat/completions",
                                    {**CHAT, "pad": "x" * (20 << 10)}, alpha)
        assert status == 413 and err["error"]["code"] == "body_too_large"
