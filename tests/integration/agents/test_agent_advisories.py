"""Issue 41 on real processes (two nodes, loopback): an advisory never makes an agent's turn
slower, a shared system prompt is locality for a new session, and a turn that ends calling
tools is advised by the scheduler itself, so the tool result's turn finds its KV in
device memory; outputs stay token-identical to recomputation (the reference is the same
request from a tenant of its own, who has nothing cached: its hashes are seeded apart)."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster, start_cluster

ALPHA = {"Authorization": "Bearer key-of-alpha"}
BETA = {"Authorization": "Bearer key-of-beta1"}
REFS = 12  # tenants that each recompute one reference (none has anything cached)
_refs = itertools.count()
OPS = {"Authorization": "Bearer key-of-ops99"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False},
    },
}
DEVICE = ("device", "device_prefetched")


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = {"anonymous": "false", "admin_keys": "key-of-ops99",
             "api_keys": ",".join(["key-of-alpha=alpha,key-of-beta1=beta",
                                   *(f"key-of-ref{i:02d}=ref{i}" for i in range(REFS))]),
             "advisory_ttl_s": 6.0, "tool_latency_default_s": 0.5}
    with start_cluster(tmp_path_factory.mktemp("agents41"), tiny_model, nodes=2,
                       scheduler_flags=flags, engine_flags={"offload.policy": "always"},
                       kvstore_flags={"chunk_tokens": 64}) as c:
        yield c


def _system(case: str) -> str:
    return f"({case}) You are one agent of a team; follow the shared rules. " * 12


def _chat(cluster: Cluster, key: dict[str, str], session: str, body: dict[str, Any],
          path: str = "/v1/chat/completions") -> tuple[dict[str, Any], str]:
    headers = {**key, **({"X-Session-Id": session} if session else {})}
    status, answer, h = cluster.post_with_headers(path, body, headers=headers)
    assert status == 200, (answer, cluster.logs())
    return answer, h.get("X-Overture-Node", "")


def _body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "demo-tiny", "messages": messages, "temperature": 0, "max_tokens": 8,
            "ignore_eos": True, "return_token_ids": True, **extra}


def _tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def _reference(cluster: Cluster, body: dict[str, Any]) -> list[int]:
    """The same request recomputed: a tenant of its own has nothing cached."""
    i = next(_refs)
    assert i < REFS, "more references than reference tenants"
    answer, _ = _chat(cluster, {"Authorization": f"Bearer key-of-ref{i:02d}"}, "", body)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return _tokens(answer)


def _metric(cluster: Cluster, prefix: str) -> float:
    text = cluster.text("/metrics", headers=OPS)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def _kv_from(answer: dict[str, Any]) -> str:
    return str(answer["usage"]["prompt_tokens_details"].get("kv_from", ""))


def _serve(cluster: Cluster, nodes: tuple[str, ...]) -> None:
    for n in ("node0", "node1"):
        status, _ = cluster.post_as(OPS, f"/admin/nodes/{n}/{'undrain' if n in nodes else 'drain'}")
        assert status == 200
    deadline = time.monotonic() + 20
    while cluster.get("/readyz")[1].get("healthy_nodes") != sorted(nodes):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)


def _wait_located(cluster: Cluster, session: str) -> str:
    deadline = time.monotonic() + 20
    while True:
        status, where = cluster.get(f"/admin/sessions/{session}?tenant=alpha", headers=OPS)
        if status == 200 and where.get("node"):
            return str(where["node"])
        assert time.monotonic() < deadline, (where, cluster.logs())
        time.sleep(0.05)


def test_a_successor_advised_while_its_predecessor_runs_on_the_holder_goes_there(
        cluster: Cluster) -> None:
    """The predecessor is expected to end before the successor arrives: it does not count,
    so the successor's advisory stays on the node holding its KV (today's load would have
    sent it to the idle node, to pull its history and recompute what did not arrive)."""
    sys_msg = {"role": "system", "content": _system("succ")}
    first = [sys_msg, {"role": "user", "content": "(succ) write the spec"}]
    answer, holder = _chat(cluster, ALPHA, "succ-engineer", _body(first))
    assert _wait_located(cluster, "succ-engineer") == holder
    other = "node1" if holder == "node0" else "node0"
    _serve(cluster, (holder,))
    # the predecessor streams on the holder: 64 tokens, a fraction of a second each at most
    pred = _body([{"role": "user", "content": "(succ) the architect's long design"}],
                 max_tokens=64, stream=True)
    started = threading.Event()

    def run_predecessor() -> None:
        req = urllib.request.Request(
            cluster.url + "/v1/chat/completions", data=json.dumps(pred).encode(),
            headers={"Content-Type": "application/json", **ALPHA,
                     "X-Session-Id": "succ-architect"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for i, _line in enumerate(r):
                if i == 8:
                    started.set()
        started.set()

    t = threading.Thread(target=run_predecessor)
    t.start()
    try:
        assert started.wait(60), cluster.logs()
        _serve(cluster, ("node0", "node1"))
        status, adv = cluster.post_as(ALPHA, "/v1/advisory", {
            "session_id": "succ-engineer", "model": "demo-tiny", "expected_arrival_s": 120})
        assert status == 202, adv
        assert adv["node"] == holder, (adv, other, cluster.logs())
    finally:
        t.join(120)
    second = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]
                       ["content"]}, {"role": "user", "content": "(succ) now the code"}]
    answer2, node = _chat(cluster, ALPHA, "succ-engineer", _body(second))
    assert node == holder and _kv_from(answer2) in DEVICE, answer2["usage"]
    assert _tokens(answer2) == _reference(cluster, _body(second))


def test_a_new_session_sharing_a_system_prompt_goes_where_it_is(cluster: Cluster) -> None:
    sys_msg = {"role": "system", "content": _system("shared")}
    _, holder = _chat(cluster, ALPHA, "team-a", _body([sys_msg, {"role": "user",
                                                                 "content": "(a) hello"}]))
    for i in range(3):  # whichever node is least recently used: the holder wins the tie
        body = _body([sys_msg, {"role": "user", "content": f"(b{i}) another task"}])
        answer, node = _chat(cluster, ALPHA, f"team-b{i}", body)
        assert node == holder, cluster.logs()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _tokens(answer) == _reference(cluster, body)


def _tool_turn(cluster: Cluster, session: str, case: str
               ) -> tuple[list[dict[str, Any]], str]:
    """A turn that ends calling a tool; the history with the tool's result, and its node."""
    ask = [{"role": "system", "content": _system(case)},
           {"role": "user", "content": f"({case}) the weather in Paris?"}]
    body = {**_body(ask, max_tokens=60, tools=[WEATHER], tool_choice="required")}
    body.pop("ignore_eos")
    answer, node = _chat(cluster, ALPHA, session, body)
    msg = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
    history = [*ask, {"role": "assistant", "content": msg.get("content") or "",
                      "tool_calls": msg["tool_calls"]}]
    history += [{"role": "tool", "tool_call_id": c["id"], "content": "18 degrees"}
                for c in msg["tool_calls"]]
    return history, node


def test_a_tool_call_turn_is_advised_and_its_result_turn_is_a_device_hit(
        cluster: Cluster) -> None:
    received = 'overture_advisories_total{event="received",source="inferred"}'
    followed = 'overture_advisories_total{event="followed",source="inferred"}'
    before = (_metric(cluster, received), _metric(cluster, followed))
    history, node = _tool_turn(cluster, "tools-chat", "chat")
    assert _metric(cluster, received) == before[0] + 1, cluster.logs()
    body = _body(history, tools=[WEATHER], tool_choice="none")
    answer, served = _chat(cluster, ALPHA, "tools-chat", body)
    assert served == node and _kv_from(answer) in DEVICE, answer["usage"]
    assert _metric(cluster, followed) == before[1] + 1
    assert _tokens(answer) == _reference(cluster, body)


def test_a_responses_function_call_is_advised_and_followed(cluster: Cluster) -> None:
    received = 'overture_advisories_total{event="received",source="inferred"}'
    followed = 'overture_advisories_total{event="followed",source="inferred"}'
    before = (_metric(cluster, received), _metric(cluster, followed))
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}  # type: ignore[index]
    first, node = _chat(cluster, ALPHA, "", {
        "model": "demo-tiny", "instructions": _system("resp"), "input": "(resp) Paris?",
        "tools": [tool], "tool_choice": "required", "temperature": 0,
        "max_output_tokens": 60}, path="/v1/responses")
    calls = [o for o in first["output"] if o["type"] == "function_call"]
    assert calls, first
    assert _metric(cluster, received) == before[0] + 1, cluster.logs()
    second, served = _chat(cluster, ALPHA, "", {
        "model": "demo-tiny", "previous_response_id": first["id"], "temperature": 0,
        "instructions": _system("resp"), "max_output_tokens": 8, "tools": [tool],
        "tool_choice": "none",
        "input": [{"type": "function_call_output", "call_id": c["call_id"],
                   "output": "18 degrees"} for c in calls]}, path="/v1/responses")
    assert served == node and second["status"] in ("completed", "incomplete"), second
    assert _metric(cluster, followed) == before[1] + 1, cluster.logs()
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_an_explicit_advisory_overrides_the_inferred_one(cluster: Cluster) -> None:
    replaced = 'overture_advisories_total{event="replaced",source="inferred"}'
    before = _metric(cluster, replaced)
    history, _ = _tool_turn(cluster, "tools-explicit", "explicit")
    status, adv = cluster.post_as(ALPHA, "/v1/advisory", {
        "session_id": "tools-explicit", "model": "demo-tiny", "expected_arrival_s": 1})
    assert status == 202 and _metric(cluster, replaced) == before + 1, adv
    followed = 'overture_advisories_total{event="followed",source="client"}'
    was = _metric(cluster, followed)
    body = _body(history, tools=[WEATHER], tool_choice="none")
    answer, served = _chat(cluster, ALPHA, "tools-explicit", body)
    assert served == adv["node"] and _metric(cluster, followed) == was + 1
    assert _tokens(answer) == _reference(cluster, body)


def test_an_abandoned_tool_loops_advisory_expires_and_frees_its_blocks(
        cluster: Cluster) -> None:
    expired = 'overture_advisories_total{event="expired",source="inferred"}'
    before = _metric(cluster, expired)
    _, node = _tool_turn(cluster, "tools-abandoned", "abandoned")
    deadline = time.monotonic() + 30
    while cluster.engine_status(node).prefetch.sessions == 0:  # held while the tool runs
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    while _metric(cluster, expired) < before + 1:  # never followed: it lapses
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    while cluster.engine_status(node).prefetch.sessions:  # and the engine lets go
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)


def test_prompt_cache_key_alone_gives_reuse_and_tenants_share_nothing(
        cluster: Cluster) -> None:
    sys_msg = {"role": "system", "content": _system("pck")}
    first = [sys_msg, {"role": "user", "content": "(pck) first"}]
    answer, _ = _chat(cluster, ALPHA, "", _body(first, prompt_cache_key="pck-shared"))
    second = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]
                       ["content"]}, {"role": "user", "content": "(pck) second"}]
    body = _body(second, prompt_cache_key="pck-shared")
    status, where = cluster.get("/admin/sessions/pck-shared?tenant=alpha", headers=OPS)
    assert status == 200 and where.get("node"), where  # the key named the session
    answer2, _ = _chat(cluster, ALPHA, "", body)
    assert answer2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert _tokens(answer2) == _reference(cluster, {**body, "prompt_cache_key": "pck-ref"})
    # beta, the same key and the same conversation: nothing of alpha's is reused
    theirs, _ = _chat(cluster, BETA, "", body)
    assert theirs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cluster.get("/admin/sessions/pck-shared?tenant=beta", headers=OPS)[0] == 200
    assert _tokens(theirs) == _tokens(answer2)


def test_a_tool_loop_that_names_no_session_is_advised_all_the_same(
        cluster: Cluster) -> None:
    """LangGraph over ChatOpenAI, the Agents SDK without previous_response_id: no session
    id, the whole history each turn. The tool call's id ties the turns together."""
    followed = 'overture_advisories_total{event="followed",source="inferred"}'
    before = _metric(cluster, followed)
    history, node = _tool_turn(cluster, "", "nosession")
    body = _body(history, tools=[WEATHER], tool_choice="none")
    answer, served = _chat(cluster, ALPHA, "", body)
    assert served == node and _kv_from(answer) in DEVICE, answer["usage"]
    assert _metric(cluster, followed) == before + 1, cluster.logs()
    assert _tokens(answer) == _reference(cluster, body)
