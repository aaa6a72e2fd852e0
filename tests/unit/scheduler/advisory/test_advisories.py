"""Advisory requests, scheduler side: the book of pending advisories, the throttle of
tenants whose advisories go unused, and the HTTP API on an in-process two-node cluster
(real scheduler and node managers, fake engines, a fake kvstore recording prefetches)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from services.local_cluster import free_port
from services.scheduler.advisory import (
    EXPIRED,
    FOLLOWED,
    LATE,
    REPLACED,
    AdvisoryBook,
    AdvisoryThrottle,
    TooManyAdvisories,
)
from shared.grpc_server import serve_grpc
from shared.proto import kvstore_pb2, kvstore_pb2_grpc
from tests.unit.scheduler.conftest import Clock, MiniCluster, call, make_cluster


def test_the_book_keeps_one_pending_advisory_per_session() -> None:
    clock = Clock()
    book = AdvisoryBook(ttl_s=10.0, capacity=3, clock=clock)
    a, ended = book.add("t1", "s1", "m", "node0", 0, expected_arrival_s=5.0)
    assert ended == [] and a.expires_at == 115.0
    b, ended = book.add("t1", "s1", "m", "node1", 0, 0.0)  # replaces a
    assert ended == [(a, REPLACED)] and book.get("t1", a.advisory_id) is None
    assert book.get("t2", b.advisory_id) is None  # another tenant's: not found
    assert book.invalidate("t2", b.advisory_id) is None
    assert book.follow("t2", "s1") == (None, "")
    assert book.follow("t1", "s1") == (b, FOLLOWED)
    assert book.follow("t1", "s1") == (None, "")  # ended once
    c, _ = book.add("t1", "s2", "m", "node0", 0, 0.0)
    d, _ = book.add("t1", "s3", "m", "node0", 0, 0.0)
    clock.now += 11.0
    assert book.follow("t1", "s2") == (c, LATE)  # lapsed: its request came late
    assert book.sweep() == [d] and len(book) == 0  # never followed: swept as expired
    for i in range(4):  # capacity 3: the oldest goes
        book.add("t1", f"x{i}", "m", "node0", 0, 0.0)
    assert len(book) == 3 and book.follow("t1", "x0") == (None, "")


def test_one_tenant_cannot_crowd_out_another() -> None:
    book = AdvisoryBook(ttl_s=10.0, capacity=4, clock=Clock(), per_tenant=3)
    victim, _ = book.add("b", "s", "m", "node0", 0, 0.0)
    for i in range(3):
        book.add("a", f"s{i}", "m", "node0", 0, 0.0)
    with pytest.raises(TooManyAdvisories):
        book.add("a", "s9", "m", "node0", 0, 0.0)
    book.add("a", "s0", "m", "node1", 0, 0.0)  # replacing its own is fine
    assert book.pending("a") == 3 and book.pending("b") == 1
    _, ended = book.add("b", "t", "m", "node0", 0, 0.0)  # full: b's own oldest goes
    assert ended == [(victim, EXPIRED)] and book.pending("a") == 3


def test_the_throttle_limits_tenants_whose_advisories_go_unused() -> None:
    clock = Clock()
    th = AdvisoryThrottle(min_useful=0.5, rate=1.0, burst=2.0, min_outcomes=4, clock=clock)
    for _ in range(3):
        th.outcome("spammy", False)
    assert th.retry_after("spammy") is None  # too few outcomes to judge
    th.outcome("spammy", False)
    assert th.throttled("spammy")
    assert th.retry_after("spammy", 3) == 1  # three at once: more than the burst holds
    assert th.retry_after("spammy") is None and th.retry_after("spammy") is None  # burst
    assert th.retry_after("spammy") == 1  # then 1 per second
    clock.now += 1.0
    assert th.retry_after("spammy") is None
    for _ in range(10):  # useful again: let go
        th.outcome("spammy", True)
    assert not th.throttled("spammy")
    th.outcome("honest", True)
    assert th.retry_after("honest") is None


class FakeKVStore(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self) -> None:
        self.prefetches: list[kvstore_pb2.PrefetchSessionRequest] = []

    async def PrefetchSession(self, request, context):
        self.prefetches.append(request)
        return kvstore_pb2.PullSessionReply(found=True, chunks=3, bytes=100)


@pytest.fixture
async def two() -> AsyncIterator[tuple[MiniCluster, list[FakeKVStore]]]:
    async with AsyncExitStack() as stack:
        stores = [FakeKVStore(), FakeKVStore()]
        ports = [free_port(), free_port()]
        for port, store in zip(ports, stores, strict=True):  # where the nodes' kvstores are
            await stack.enter_async_context(serve_grpc(
                "127.0.0.1", port,
                register=[lambda s, k=store: kvstore_pb2_grpc.add_KVStoreServicer_to_server(k, s)],
                service_names=["overture.v1.KVStore"], grace_s=0.1))
        c = await make_cluster(stack, nodes=2, kvstore_ports=ports, advisory_ttl_s=0.2,
                               advisory_throttle_after=2, advisory_min_useful=0.5,
                               advisory_throttle_rate=0.05)
        yield c, stores


async def until(ok, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not ok():
        assert loop.time() < deadline, "never happened"
        await asyncio.sleep(0.02)


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


async def test_an_advised_turn_goes_where_its_kv_was_prefetched(two) -> None:
    c, stores = two
    status, turn, headers = await call(c, "POST", "/v1/chat/completions", CHAT,
                                       {"X-Session-Id": "s1"})
    assert status == 200
    holder = headers["X-Overture-Node"]
    other = "node1" if holder == "node0" else "node0"
    # The holder is drained: the advisory picks the other node, which is told to prefetch
    # from the holder's kvstore.
    assert (await call(c, "POST", f"/admin/nodes/{holder}/drain"))[0] == 200
    status, adv, _ = await call(c, "POST", "/v1/advisory",
                                {"session_id": "s1", "model": "demo", "expected_arrival_s": 5})
    assert status == 202 and adv["node"] == other and adv["advisory_id"].startswith("adv-")
    assert adv["successors"] == [] and adv["expires_at"] > 0
    store = stores[int(other[-1])]
    for _ in range(100):
        if store.prefetches:
            break
        await asyncio.sleep(0.02)
    sent = store.prefetches[-1]
    assert (sent.session.session_id, sent.session.tenant) == ("s1", "default")
    assert sent.peer_address == f"127.0.0.1:{c.kvstore_ports[int(holder[-1])]}"
    # The turn's length: the holder waits for its save of the turn if still running.
    assert sent.wait_tokens == turn["usage"]["total_tokens"] > 0
    # Undrained and made busier, the holder would win a tie; the advised node wins anyway.
    assert (await call(c, "POST", f"/admin/nodes/{holder}/undrain"))[0] == 200
    c.scheduler.state.registry.begin(other)
    status, _, headers = await call(c, "POST", "/v1/chat/completions", CHAT,
                                    {"X-Session-Id": "s1"})
    c.scheduler.state.registry.end(other)
    assert status == 200 and headers["X-Overture-Node"] == other
    metrics = await (await c.http.get(c.url + "/metrics")).text()
    assert 'overture_advisories_total{event="followed",source="client"} 1.0' in metrics
    assert "overture_advisory_lead_time_seconds_count 1.0" in metrics
    # Followed: it is gone.
    status, body, _ = await call(c, "DELETE", f"/v1/advisory/{adv['advisory_id']}")
    assert status == 404 and body["error"]["code"] == "advisory_not_found"


async def test_successors_and_invalidation(two) -> None:
    c, _ = two
    status, adv, _ = await call(c, "POST", "/v1/advisory", {
        "session_id": "planner", "model": "demo",
        "successors": [{"session_id": "coder", "model": "demo", "expected_arrival_s": 2},
                       {"session_id": "tester", "model": "demo"}]})
    assert status == 202 and [s["session_id"] for s in adv["successors"]] == ["coder", "tester"]
    # Each node prefetches into its kvstore's DRAM, then its engine's device.
    engines = {f"node{i}": e for i, e in enumerate(c.engines)}
    coder = adv["successors"][0]
    engine = engines[coder["node"]]
    await until(lambda: any(p.session_id == "coder" for p in engine.prefetches))
    sent = next(p for p in engine.prefetches if p.session_id == "coder")
    assert sent.tenant == "default" and 0 < sent.ttl_s <= 2.2 and not sent.straight_to_device
    status, body, _ = await call(c, "DELETE", f"/v1/advisory/{coder['advisory_id']}")
    assert status == 200 and body["deleted"] is True
    # The engine frees the invalidated session's device blocks.
    await until(lambda: any(e.session_id == "coder" for e in engine.ended))
    assert [e.expired for e in engine.ended if e.session_id == "coder"] == [False]
    metrics = await (await c.http.get(c.url + "/metrics")).text()
    assert 'overture_advisories_total{event="received",source="client"} 3.0' in metrics
    assert 'overture_advisories_total{event="invalidated",source="client"} 1.0' in metrics


@pytest.mark.parametrize("body, param, status", [
    ({"model": "demo"}, "session_id", 400),
    ({"session_id": "", "model": "demo"}, "session_id", 400),
    ({"session_id": "s" * 300, "model": "demo"}, "session_id", 400),
    ({"session_id": "s"}, "model", 400),
    ({"session_id": "s", "model": "nope"}, "model", 404),
    ({"session_id": "s", "model": "demo", "expected_arrival_s": -1}, "expected_arrival_s", 400),
    ({"session_id": "s", "model": "demo", "expected_arrival_s": "soon"},
     "expected_arrival_s", 400),
    ({"session_id": "s", "model": "demo", "priority": 1.5}, "priority", 400),
    ({"session_id": "s", "model": "demo", "colour": "red"}, "colour", 400),
    ({"session_id": "s", "model": "demo", "successors": "x"}, "successors", 400),
    ({"session_id": "s", "model": "demo", "successors": [{"model": "demo"}]},
     "successors[0].session_id", 400),
    ({"session_id": "s", "model": "demo", "successors": [{"session_id": "a", "model": "x"}]},
     "successors[0].model", 404),
    ({"session_id": "a/b", "model": "demo"}, "session_id", 400),
    ({"session_id": "s", "model": "demo", "successors": [{"session_id": "s", "model": "demo"}]},
     "successors", 400),
])
async def test_bad_advisories_get_openai_errors(two, body, param, status) -> None:
    c, _ = two
    got, answer, _ = await call(c, "POST", "/v1/advisory", body)
    assert got == status and answer["error"]["param"] == param, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    async with c.http.post(c.url + "/v1/advisory", data=b"[1]") as r:  # not an object
        assert r.status == 400


async def test_another_tenants_advisory_is_not_found() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, nodes=1, api_keys={"key-alpha": "alpha", "key-beta": "beta"})
        a = {"Authorization": "Bearer key-alpha"}
        b = {"Authorization": "Bearer key-beta"}
        status, _, _ = await call(c, "POST", "/v1/advisory", {"session_id": "s", "model": "demo"})
        assert status == 401
        status, adv, _ = await call(c, "POST", "/v1/advisory",
                                    {"session_id": "s", "model": "demo"}, a)
        assert status == 202
        status, _, _ = await call(c, "DELETE", f"/v1/advisory/{adv['advisory_id']}", None, b)
        assert status == 404
        status, _, _ = await call(c, "DELETE", f"/v1/advisory/{adv['advisory_id']}", None, a)
        assert status == 200


async def test_a_tenant_whose_advisories_go_unused_is_throttled(two) -> None:
    c, _ = two
    for i in range(2):  # TTL 0.2 s, never followed: spurious
        status, _, _ = await call(c, "POST", "/v1/advisory",
                                  {"session_id": f"ghost{i}", "model": "demo"})
        assert status == 202
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        status, body, headers = await call(c, "POST", "/v1/advisory",
                                           {"session_id": "more", "model": "demo"})
        if status == 429:
            break
        assert status == 202 and loop.time() < deadline
        await asyncio.sleep(0.3)
    assert body["error"]["code"] == "advisories_throttled" and int(headers["Retry-After"]) >= 1
    metrics = await (await c.http.get(c.url + "/metrics")).text()
    assert 'overture_advisories_total{event="expired",source="client"}' in metrics
    assert 'overture_advisories_total{event="throttled",source="client"} 1.0' in metrics
    # An expired advisory's device blocks become the first to purge on its node.
    await until(lambda: any(e.session_id == "ghost0" and e.expired
                            for eng in c.engines for e in eng.ended))
    # Requests themselves are never throttled by this.
    status, _, _ = await call(c, "POST", "/v1/chat/completions", CHAT, {"X-Session-Id": "x"})
    assert status == 200


async def test_advisories_made_while_the_nodes_idle_are_spread_and_counted_until_they_end(
    two,
) -> None:
    # Placing by the load of the moment sent every advisory of an idle cluster to the
    # same node (its requests then all came there): each pending advisory counts as a
    # request on its way until it is followed, invalidated or expires.
    c, _ = two
    reg = c.scheduler.state.registry
    nodes, ids = [], []
    for i in range(6):
        status, adv, _ = await call(c, "POST", "/v1/advisory",
                                    {"session_id": f"idle{i}", "model": "demo",
                                     "expected_arrival_s": 30})
        assert status == 202
        nodes.append(adv["node"])
        ids.append(adv["advisory_id"])
    assert sorted(nodes) == ["node0"] * 3 + ["node1"] * 3, nodes
    assert [reg.get(n).advised for n in ("node0", "node1")] == [3, 3]
    status, _, headers = await call(c, "POST", "/v1/chat/completions", CHAT,
                                    {"X-Session-Id": "idle0"})
    assert status == 200 and headers["X-Overture-Node"] == nodes[0]  # followed
    assert (await call(c, "DELETE", f"/v1/advisory/{ids[1]}"))[0] == 200  # invalidated
    again, _, _ = await call(c, "POST", "/v1/advisory",  # replaces idle2's
                             {"session_id": "idle2", "model": "demo",
                              "expected_arrival_s": 30})
    assert again == 202
    # Pending now: idle3, idle4, idle5 and idle2's replacement.
    assert sum(reg.get(n).advised for n in ("node0", "node1")) == 4


async def test_a_request_no_node_takes_leaves_its_advisory_for_the_retry(two) -> None:
    # Refused before any node took it (none in rotation here; every node at capacity is
    # the same path), the request does not use up its advisory: the client's retry
    # follows it to the node holding the prefetched KV.
    c, _ = two
    status, adv, _ = await call(c, "POST", "/v1/advisory",  # (outlives the 0.5 s wait)
                                {"session_id": "r1", "model": "demo", "expected_arrival_s": 30})
    assert status == 202
    for n in ("node0", "node1"):
        assert (await call(c, "POST", f"/admin/nodes/{n}/drain"))[0] == 200
    status, body, _ = await call(c, "POST", "/v1/chat/completions", CHAT, {"X-Session-Id": "r1"})
    assert status == 503, body
    book = c.scheduler.state.dispatcher.advisor.book
    assert book.pending_for("default", "r1") is not None
    for n in ("node0", "node1"):
        assert (await call(c, "POST", f"/admin/nodes/{n}/undrain"))[0] == 200
    other = "node1" if adv["node"] == "node0" else "node0"
    c.scheduler.state.registry.begin(adv["node"])  # busier: only the advisory sends it there
    status, _, headers = await call(c, "POST", "/v1/chat/completions", CHAT,
                                    {"X-Session-Id": "r1"})
    c.scheduler.state.registry.end(adv["node"])
    assert status == 200 and headers["X-Overture-Node"] == adv["node"] != other
    assert book.pending_for("default", "r1") is None
    metrics = await (await c.http.get(c.url + "/metrics")).text()
    assert 'overture_advisories_total{event="followed",source="client"} 1.0' in metrics


def test_a_restarted_scheduler_tells_an_advisory_of_its_predecessor() -> None:
    # Pending advisories are not persisted (issue 43: they last seconds, and what they set
    # in motion is on the nodes); a restarted scheduler says so instead of "unknown".
    before = AdvisoryBook(ttl_s=10.0, capacity=3, clock=Clock())
    adv, _ = before.add("t1", "s1", "m", "node0", 0, 0.0)
    assert len(adv.advisory_id) == len("adv-") + 24
    after = AdvisoryBook(ttl_s=10.0, capacity=3, clock=Clock())  # a new process
    assert after.made_before_restart(adv.advisory_id)
    assert not before.made_before_restart(adv.advisory_id)  # its own
    mine, _ = after.add("t1", "s1", "m", "node0", 0, 0.0)
    assert not after.made_before_restart(mine.advisory_id)
    assert not after.made_before_restart("adv-nonsense")


async def test_deleting_an_advisory_made_before_a_restart_says_so(two) -> None:
    c, _ = two
    other = AdvisoryBook(ttl_s=10.0, capacity=3, clock=Clock())  # the predecessor's
    old, _ = other.add("default", "s1", "m", "node0", 0, 0.0)
    status, body, _ = await call(c, "DELETE", f"/v1/advisory/{old.advisory_id}")
    assert status == 404 and body["error"]["code"] == "advisory_lost_in_restart", body
    status, body, _ = await call(c, "DELETE", "/v1/advisory/adv-unknown")
    assert status == 404 and body["error"]["code"] == "advisory_not_found", body
