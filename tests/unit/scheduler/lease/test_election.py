"""Leader election through a Kubernetes Lease, against a small fake API server (aiohttp,
in-process) that keeps one Lease and refuses a write whose resourceVersion is stale (409),
as the real one does: one leader at a time, renewals keep it, a standby takes over once the
record stops changing for the lease duration (by its own clock) or at once when released,
and a leader cut off from the API server stops serving before anyone else may start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.scheduler.lease import LeaseElector, LeaseSettings

LEASES = "/apis/coordination.k8s.io/v1/namespaces/ovt/leases"


class FakeApiServer:
    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.get_delay_s = 0.0
        self.broken = False
        self.writes: list[str] = []  # the holder each accepted write named

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get(LEASES + "/{name}", self.get)
        app.router.add_put(LEASES + "/{name}", self.put)
        app.router.add_post(LEASES, self.post)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.broken:
            return web.json_response({"message": "etcd unavailable"}, status=500)
        if request.headers.get("Authorization") != "Bearer sa-token":
            return web.json_response({"message": "Unauthorized"}, status=401)
        return await handler(request)

    def _stored(self, body: dict[str, Any]) -> web.Response:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body
        self.writes.append(body["spec"]["holderIdentity"])
        return web.json_response(body)

    async def get(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.get_delay_s)
        if self.lease is None:
            return web.json_response({"message": "not found"}, status=404)
        return web.json_response(self.lease)

    async def put(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.lease is None:
            return web.json_response({"message": "not found"}, status=404)
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            return web.json_response({"message": "the object has been modified"}, status=409)
        return self._stored(body)

    async def post(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.lease is not None:
            return web.json_response({"message": "already exists"}, status=409)
        response = self._stored(body)
        response.set_status(201)
        return response


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()
    server = TestServer(fake.app())
    await server.start_server()
    yield fake, str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
def token(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("sa-token\n")
    return str(path)


def elector(url: str, token: str, who: str, http: aiohttp.ClientSession, clock: Clock,
            changes: list[bool] | None = None) -> LeaseElector:
    settings = LeaseSettings("overture-scheduler", "ovt", who, url, token, "",
                             duration_s=6.0, renew_s=1.0)
    return LeaseElector(settings, http, clock,
                        on_change=changes.append if changes is not None else None)


async def test_one_leader_renews_and_the_standby_waits(api, token) -> None:
    fake, url = api
    clock = Clock()
    async with aiohttp.ClientSession() as http:
        changes: list[bool] = []
        a = elector(url, token, "pod-a", http, clock, changes)
        b = elector(url, token, "pod-b", http, clock)
        await a.step()
        await b.step()
        assert a.is_leader and not b.is_leader and changes == [True]
        for _ in range(10):  # far past the duration, but renewed every round
            clock.now += 1.0
            await a.step()
            await b.step()
        assert a.is_leader and not b.is_leader
        assert set(fake.writes) == {"pod-a"} and fake.lease["spec"]["leaseTransitions"] == 0


async def test_the_standby_takes_over_a_lease_that_stopped_changing(api, token) -> None:
    fake, url = api
    clock = Clock()
    async with aiohttp.ClientSession() as http:
        a = elector(url, token, "pod-a", http, clock)
        b = elector(url, token, "pod-b", http, clock)
        await a.step()
        await b.step()
        clock.now += 5.0  # a is killed: no more renewals
        await b.step()
        assert not b.is_leader  # (5 s unchanged < 6 s)
        clock.now += 1.5
        await b.step()
        assert b.is_leader
        assert fake.lease["spec"]["holderIdentity"] == "pod-b"
        assert fake.lease["spec"]["leaseTransitions"] == 1
        await a.step()  # a comes back: the record names b, freshly renewed
        assert not a.is_leader


async def test_of_two_writers_of_one_version_the_api_server_keeps_one(api, token) -> None:
    fake, url = api
    clock = Clock()
    async with aiohttp.ClientSession() as http:
        first = elector(url, token, "pod-0", http, clock)
        await first.step()
        await first.release()  # held by nobody: both may take it
        assert fake.lease["spec"]["holderIdentity"] == ""
        a = elector(url, token, "pod-a", http, clock)
        b = elector(url, token, "pod-b", http, clock)
        fake.get_delay_s = 0.05  # both read the same resourceVersion before either writes
        await asyncio.gather(a.step(), b.step())
        assert [a.is_leader, b.is_leader].count(True) == 1
        assert fake.lease["spec"]["holderIdentity"] == ("pod-a" if a.is_leader else "pod-b")


async def test_a_released_lease_is_taken_at_the_next_look(api, token) -> None:
    fake, url = api
    clock = Clock()
    async with aiohttp.ClientSession() as http:
        a = elector(url, token, "pod-a", http, clock)
        b = elector(url, token, "pod-b", http, clock)
        await a.step()
        await b.step()
        run = asyncio.create_task(a.run())  # (a clean stop releases the lease)
        await asyncio.sleep(0.05)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        assert not a.is_leader
        assert fake.lease["spec"]["holderIdentity"] == ""
        await b.step()  # no waiting for the duration
        assert b.is_leader


async def test_a_leader_cut_off_from_the_api_server_stops_serving_in_time(api, token) -> None:
    fake, url = api
    clock = Clock()
    async with aiohttp.ClientSession() as http:
        changes: list[bool] = []
        a = elector(url, token, "pod-a", http, clock, changes)
        await a.step()
        fake.broken = True
        clock.now += 4.0
        await a.step()
        assert a.is_leader  # renewals failing for 4 s < 6 - 1
        clock.now += 1.0
        await a.step()
        assert not a.is_leader and changes == [True, False]
        # The standby cannot have taken over yet: it needs 6 s without a change.


async def test_a_wrong_token_never_leads(api, tmp_path) -> None:
    fake, url = api
    bad = tmp_path / "bad"
    bad.write_text("nope")
    async with aiohttp.ClientSession() as http:
        a = elector(url, str(bad), "pod-a", http, Clock())
        await a.step()
        assert not a.is_leader and fake.lease is None
