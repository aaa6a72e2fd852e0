"""Per-tenant limits: requests and advisories per second (token buckets) and generations
in flight; beyond them 429 with Retry-After, and only for that tenant."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from services.scheduler.tenants import TokenBuckets
from tests.unit.scheduler.conftest import call, make_cluster

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2}
A = {"Authorization": "Bearer key-of-alpha"}
B = {"Authorization": "Bearer key-of-beta1"}
KEYS = {"key-of-alpha": "alpha", "key-of-beta1": "beta"}


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    now = [0.0]
    buckets = TokenBuckets(rate=2.0, burst=4.0, clock=lambda: now[0])
    assert [buckets.take("t") for _ in range(4)] == [None] * 4
    assert buckets.take("t") == 1 and buckets.take("other") is None
    now[0] += 0.5  # one token back
    assert buckets.take("t") is None and buckets.take("t") == 1
    now[0] += 100  # never more than the burst
    assert [buckets.take("t") for _ in range(5)] == [None] * 4 + [1]
    assert TokenBuckets(0.0, 0.0).take("t") is None  # (0: no limit)


async def test_requests_and_advisories_per_second_per_tenant() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, api_keys=KEYS, tenant_requests_per_s=1.0,
                               tenant_advisories_per_s=1.0)
        codes = [(await call(c, "POST", "/v1/chat/completions", CHAT, A))[0]
                 for _ in range(3)]
        assert codes == [200, 200, 429]  # a burst of two seconds' worth
        status, err, headers = await call(c, "POST", "/v1/chat/completions", CHAT, A)
        assert status == 429 and err["error"]["code"] == "rate_limit_exceeded"
        assert int(headers["Retry-After"]) >= 1
        assert (await call(c, "POST", "/v1/chat/completions", CHAT, B))[0] == 200
        adv = {"session_id": "s", "model": "demo"}
        codes = [(await call(c, "POST", "/v1/advisory", adv, A))[0] for _ in range(3)]
        assert codes == [202, 202, 429]


async def test_generations_in_flight_per_tenant() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, api_keys=KEYS, tenant_max_in_flight=1,
                               token_delay_s=0.2)
        slow = {**CHAT, "max_tokens": 5}
        first = asyncio.create_task(call(c, "POST", "/v1/chat/completions", slow, A))
        await asyncio.sleep(0.3)
        status, err, headers = await call(c, "POST", "/v1/chat/completions", CHAT, A)
        assert status == 429 and err["error"]["code"] == "too_many_requests_in_flight"
        assert headers["Retry-After"] == "1"
        assert (await call(c, "POST", "/v1/chat/completions", CHAT, B))[0] == 200
        assert (await first)[0] == 200
        assert (await call(c, "POST", "/v1/chat/completions", CHAT, A))[0] == 200
