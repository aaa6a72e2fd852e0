"""A scheduler killed with SIGKILL loses nothing a user sees (real processes on loopback,
2 nodes, no S3, so nothing but the scheduler's rebuilt directory can bring a session's
KV to its next turn): the node managers ride out the outage and register again, a
Responses chain continues from ``previous_response_id`` (the stored responses are in the
scheduler's state folder), and a conversation's next turn goes to the node holding its KV
and reuses it, token for token what recomputation gives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.api_types import ChatMessage
from services.engine.model import load_model
from tests.cluster import Cluster, restart_scheduler, start_cluster
from tests.integration.reuse.harness import SYSTEM, USER_TURNS, reference_transcript

pytestmark = pytest.mark.slow

ENGINE = {"offload.policy": "always"}  # the tiny model recomputes fast: always load


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[tuple[list[ChatMessage], list[int], str]]:
    loaded = load_model(tiny_model, dtype=torch.float32)
    return asyncio.run(reference_transcript(loaded, USER_TURNS[:2]))


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scheduler-state")


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, state_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("restart"), tiny_model, nodes=2,
                       engine_flags=ENGINE, kvstore_flags={"chunk_tokens": 64},
                       scheduler_flags={"state_dir": state_dir}) as c:
        yield c


def chat(cluster: Cluster, session: str, messages: list[ChatMessage]
         ) -> tuple[list[int], int, str]:
    """(output tokens, cached prompt tokens, serving node) of one turn."""
    body = {"messages": [{"role": m.role, "content": m.content} for m in messages],
            "max_tokens": 10, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    status, answer, headers = cluster.post_with_headers(
        "/v1/chat/completions", body, headers={"X-Session-Id": session})
    assert status == 200, (answer, cluster.logs())
    return (answer["choices"][0]["token_ids"],
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            headers.get("X-Overture-Node", ""))


def wait_saved(cluster: Cluster, session: str) -> None:
    """Until the scheduler has taken the node's report that the session's KV is saved."""
    deadline = time.monotonic() + 30
    while True:
        status, place = cluster.get(f"/admin/sessions/{session}")
        if status == 200 and place["saved_tokens"] > 0:
            return
        assert time.monotonic() < deadline, (place, cluster.logs())
        time.sleep(0.1)


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_a_killed_scheduler_loses_no_node_no_chain_and_no_session(
        cluster: Cluster, state_dir: Path,
        reference: list[tuple[list[ChatMessage], list[int], str]]) -> None:
    (first, first_tokens, _), (second, second_tokens, _) = reference
    # Two conversations: the first lands on node0, the second on node1 (least routed; the
    # first's system prompt differs, so node0 holds no prefix of the second's).
    other = [ChatMessage("system", "You are terse."), *first[1:]]
    assert chat(cluster, "s-a", other)[2] == "node0"
    tokens, _, node_b = chat(cluster, "s-b", first)
    assert tokens == first_tokens and node_b == "node1"
    status, r1 = cluster.post("/v1/responses", {
        "instructions": SYSTEM, "input": USER_TURNS[0], "temperature": 0,
        "max_output_tokens": 10})
    assert status == 200, (r1, cluster.logs())
    wait_saved(cluster, "s-b")

    cluster.kill("scheduler")  # SIGKILL: no goodbye to anyone
    time.sleep(2.0)  # heartbeats every 0.2 s meet the dead scheduler many times meanwhile
    dead = [p.name for p in cluster.procs.values()
            if p.name != "scheduler" and p.popen.poll() is not None]
    assert not dead, cluster.logs()  # every node manager rode it out
    restart_scheduler(cluster, {"state_dir": state_dir})
    cluster.wait_ready(2, 60.0)

    # The chain continues: the stored response resolves, and its next turn answers the
    # whole conversation as a fresh chat of it does.
    status, again = cluster.get(f"/v1/responses/{r1['id']}")
    assert status == 200 and again["id"] == r1["id"], again
    status, r2 = cluster.post("/v1/responses", {
        "instructions": SYSTEM, "input": USER_TURNS[1], "previous_response_id": r1["id"],
        "temperature": 0, "max_output_tokens": 10})
    assert status == 200, (r2, cluster.logs())
    history = [ChatMessage("system", SYSTEM), ChatMessage("user", USER_TURNS[0]),
               ChatMessage("assistant", text_of(r1)), ChatMessage("user", USER_TURNS[1])]
    body = {"messages": [{"role": m.role, "content": m.content} for m in history],
            "max_tokens": 10, "temperature": 0}
    status, fresh = cluster.post("/v1/chat/completions", body)
    assert status == 200, fresh
    assert text_of(r2) == fresh["choices"][0]["message"]["content"]

    # The conversation on node1 goes back to node1 and reuses its KV, exactly.
    cluster.wait_idle(2)
    tokens, cached, node = chat(cluster, "s-b", second)
    assert node == "node1", cluster.logs()
    assert cached > 0, cluster.logs()
    assert tokens == second_tokens
