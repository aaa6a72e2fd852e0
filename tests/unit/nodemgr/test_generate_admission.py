"""The nodemgr's Generate behind its deadline queue (Prism §6.3): a request it dispatches is
marked so that the engine does not refuse it as late; a full node queue refuses (429)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import pytest

from services.nodemgr.admission import DeadlineAdmission
from services.nodemgr.grpc_service import NodeManagerServicer
from shared.proto import common_pb2


class Call:
    """A fake engine stream: once released, a first token and the end."""

    def __init__(self, request: common_pb2.GenerateRequest, release: asyncio.Event) -> None:
        self.request = request
        self.release = release

    def __aiter__(self) -> Any:
        return self._chunks()

    async def _chunks(self) -> Any:
        await self.release.wait()
        yield common_pb2.GenerateChunk(request_id=self.request.request_id, token_ids=[1],
                                       prompt_tokens=3)
        yield common_pb2.GenerateChunk(request_id=self.request.request_id,
                                       finish_reason="length")

    def cancel(self) -> None:
        pass


class Link:
    def __init__(self, address: str) -> None:
        self.address = address
        self.sent: list[common_pb2.GenerateRequest] = []
        self.release = asyncio.Event()
        self.stub = self

    def Generate(self, request: common_pb2.GenerateRequest, timeout: float | None) -> Call:
        self.sent.append(request)
        return Call(request, self.release)


class Engines:
    def __init__(self, links: list[Link]) -> None:
        self.links = links


class Activator:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.catalog: dict[str, object] = {}  # (no catalogue model: none is activated)

    def enter(self, model: str) -> None:
        pass

    def leave(self, model: str) -> None:
        pass

    async def engine_for(self, model: str) -> Link:
        return self.link


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def time_remaining(self) -> float:
        return 30.0

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


def servicer(links: list[Link], admission: DeadlineAdmission) -> NodeManagerServicer:
    return NodeManagerServicer("node0", cast(Any, Engines(links)), "kv:1", lambda why: None,
                               activator=cast(Any, Activator(links[0])), admission=admission)


def request(rid: str, node_admitted: bool = False) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(request_id=rid, model="m", prompt="hello there",
                                      node_admitted=node_admitted)


async def drain(s: NodeManagerServicer, req: common_pb2.GenerateRequest, ctx: Context
                ) -> list[common_pb2.GenerateChunk]:
    return [c async for c in s.Generate(req, cast(Any, ctx))]


async def test_the_node_queue_marks_what_it_dispatches_and_refuses_when_full() -> None:
    links = [Link("e0"), Link("e1")]  # several engines: the node's queue orders them
    s = servicer(links, DeadlineAdmission(depth=1, max_waiting=1))
    first = asyncio.create_task(drain(s, request("r1"), Context()))
    for _ in range(100):
        if links[0].sent:
            break
        await asyncio.sleep(0)
    assert links[0].sent[0].node_admitted  # the engine must not refuse it as late
    second = asyncio.create_task(drain(s, request("r2"), Context()))  # waits: depth 1
    for _ in range(100):
        if s.admission.waiting:
            break
        await asyncio.sleep(0)
    assert [r.request_id for r in links[0].sent] == ["r1"] and s.admission.waiting == 1
    ctx = Context()
    with pytest.raises(Aborted):
        await drain(s, request("r3"), ctx)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in ctx.details
    links[0].release.set()
    chunks = await first
    assert chunks[-1].finish_reason == "length"
    assert (await second)[-1].finish_reason == "length"
    assert [r.request_id for r in links[0].sent] == ["r1", "r2"] and s.admission.waiting == 0


async def test_a_lone_engine_keeps_its_own_delay_bound() -> None:
    """One engine orders (and refuses) its own queue: the flag is cleared, even if set."""
    link = Link("e0")
    link.release.set()
    s = servicer([link], DeadlineAdmission(depth=1))
    await drain(s, request("r1", node_admitted=True), Context())
    assert not link.sent[0].node_admitted
