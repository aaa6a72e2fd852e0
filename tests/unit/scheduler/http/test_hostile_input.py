"""What was found from outside, fixed: every malformed input gets a 4xx in the OpenAI shape
(never a 500), protocol errors included; slow clients are cut off; unknown model names
never become metric labels; error messages name no internal address; a prompt that
cannot fit is refused before a node tokenizes it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from services.scheduler.api import ChoiceState, from_grpc, without_addresses
from services.scheduler.api.openai_format import usage
from tests.unit.scheduler.conftest import MiniCluster, call, make_cluster

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2}


@pytest.fixture
async def c() -> AsyncIterator[MiniCluster]:
    async with AsyncExitStack() as stack:
        yield await make_cluster(stack, header_timeout_s=0.3, body_timeout_s=0.3,
                                 max_messages=4, max_tokens_limit=100)


async def _raw(c: MiniCluster, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send raw bytes to the scheduler's HTTP port; everything it answers until it closes."""
    port = c.scheduler.http_port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait_s)
    finally:
        writer.close()


def _error_of(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def _post(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n"
            ).encode() + body


async def test_malformed_bodies_and_session_ids_get_400s(c: MiniCluster) -> None:
    nested = b'{"model": "demo", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    surrogate = json.dumps({**CHAT, "messages": [
        {"role": "user", "content": "\ud800"}]}).encode()  # (json escapes it: valid JSON)
    for body, headers in ((nested, ""), (surrogate, ""),
                          (json.dumps(CHAT).encode(), "X-Session-Id: \xff\xfe\r\n"),
                          (json.dumps({**CHAT, "session_id": "a/b"}).encode(), ""),
                          (json.dumps({**CHAT, "session_id": "s" * 257}).encode(), ""),
                          (json.dumps({**CHAT, "max_tokens": 101}).encode(), ""),
                          (json.dumps({**CHAT, "messages": CHAT["messages"] * 5}).encode(),
                           "")):
        data = _post("/v1/chat/completions", body, "")
        if headers:  # (latin-1: the raw bytes go out as they are)
            data = data.replace(b"Connection: close\r\n",
                                b"Connection: close\r\n" + headers.encode("latin-1"))
        status, err = _error_of(await _raw(c, data))
        assert status == 400 and err["type"] == "invalid_request_error", (body[:80], err)
    # The developer role is OpenAI's system role.
    dev = {**CHAT, "messages": [{"role": "developer", "content": "be brief"},
                                {"role": "user", "content": "hi"}]}
    assert (await call(c, "POST", "/v1/chat/completions", dev))[0] == 200


async def test_protocol_errors_are_in_the_openai_shape(c: MiniCluster) -> None:
    for data in (b"GARBAGE\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
                 + b"a" * 10_000 + b"\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n"):
        status, err = _error_of(await _raw(c, data))
        assert 400 <= status < 500 and err["code"] == "bad_http_request", err


async def test_slow_clients_are_cut_off(c: MiniCluster) -> None:
    # Headers trickling in: the connection is closed at the header deadline.
    assert await _raw(c, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", wait_s=3.0) == b""
    # A body that never completes: 408 at the body deadline.
    data = _post("/v1/chat/completions", b"{}")
    data = data.replace(b"Content-Length: 2", b"Content-Length: 5000")
    status, err = _error_of(await _raw(c, data, wait_s=3.0))
    assert status == 408 and err["code"] == "body_timeout"


async def test_unknown_models_are_no_metric_labels_and_huge_prompts_stop_early(
    c: MiniCluster,
) -> None:
    for i in range(5):
        status, _, _ = await call(c, "POST", "/v1/chat/completions",
                                  {**CHAT, "model": f"no-such-model-{i}"})
        assert status == 404
    async with c.http.get(c.url + "/metrics") as r:
        assert "no-such-model" not in await r.text()
    # The fake node's context is 64 tokens: 3 MB of text is refused by the scheduler.
    big = {**CHAT, "messages": [{"role": "user", "content": "word " * 600_000}]}
    status, err, _ = await call(c, "POST", "/v1/chat/completions", big)
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert not any(len(r.prompt) > 1000 for r in c.engine.requests)  # never sent on


def test_clients_learn_no_internal_address() -> None:
    import grpc

    err = from_grpc(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last "
                    "error: ipv4:10.1.2.3:50051: Connection refused", "node0")
    assert "10.1.2.3" not in err.message and "node0" in err.message
    assert without_addresses("peer [fd00::1]:9000 and 127.0.0.1") == (
        "peer [internal] and [internal]")


def test_cached_tokens_are_not_overstated_by_sibling_choices() -> None:
    """The second of n choices may reuse the first one's fresh prompt KV: that was not
    cached when the request came."""
    a, b = ChoiceState(0, 0), ChoiceState(1, 0)
    a.prompt_tokens = b.prompt_tokens = 40
    a.cached_tokens, b.cached_tokens = 0, 32
    assert usage([a, b])["prompt_tokens_details"]["cached_tokens"] == 0
