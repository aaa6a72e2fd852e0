"""A request whose engine dies before the first token reaches the client completes on the
other node (real processes on loopback, 2 nodes): streaming or not, the client sees one
whole answer, token for token what recomputation gives, never an error.

The engine dies deterministically: with ``engine.debug_die_on_sigusr1`` a SIGUSR1 makes
it exit as its next generation request arrives. A conversation's second turn goes to the
node of its first (the holder of its KV), whose engine is armed that way."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.api_types import ChatMessage
from services.engine.model import load_model
from tests.cluster import Cluster, start_cluster
from tests.integration.reuse.harness import USER_TURNS, reference_transcript

pytestmark = pytest.mark.slow

Transcript = list[tuple[list[ChatMessage], list[int], str]]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Transcript:
    loaded = load_model(tiny_model, dtype=torch.float32)
    return asyncio.run(reference_transcript(loaded, USER_TURNS[:2]))


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("retry"), tiny_model, nodes=2,
                       engine_flags={"debug_die_on_sigusr1": "true"}) as c:
        yield c


def body(messages: list[ChatMessage], stream: bool) -> dict:
    return {"messages": [{"role": m.role, "content": m.content} for m in messages],
            "max_tokens": 10, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "stream": stream}


def stream_turn(cluster: Cluster, session: str, messages: list[ChatMessage]
                ) -> tuple[list[int], str]:
    """(output tokens, serving node) of a streamed turn; fails on an error event."""
    req = urllib.request.Request(
        cluster.url + "/v1/chat/completions", data=json.dumps(body(messages, True)).encode(),
        headers={"Content-Type": "application/json", "X-Session-Id": session})
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        node = r.headers.get("X-Overture-Node", "")
        for line in r.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
    return tokens, node


def turn(cluster: Cluster, session: str, messages: list[ChatMessage]) -> tuple[list[int], str]:
    status, answer, headers = cluster.post_with_headers(
        "/v1/chat/completions", body(messages, False), headers={"X-Session-Id": session},
        timeout=120)
    assert status == 200, (answer, cluster.logs())
    return answer["choices"][0]["token_ids"], headers.get("X-Overture-Node", "")


def arm(cluster: Cluster, node: str) -> None:
    """Make ``node``'s engine exit at its next generation request."""
    proc = cluster.procs[f"{node}.engine"]
    proc.popen.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "exits at its next generation request" not in proc.tail(20):
        assert time.monotonic() < deadline, proc.tail()
        time.sleep(0.05)


def restart_engine(cluster: Cluster, node: str) -> None:
    proc = cluster.procs[f"{node}.engine"]
    cluster.spawn(proc.name, [str(a) for a in proc.popen.args])
    deadline = time.monotonic() + 120
    while True:
        status, ready = cluster.get("/readyz")
        if status == 200 and sorted(ready["healthy_nodes"]) == ["node0", "node1"]:
            return
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)


def other(node: str) -> str:
    return "node1" if node == "node0" else "node0"


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
def test_an_engine_dying_before_the_first_token_costs_the_client_nothing(
        cluster: Cluster, reference: Transcript, stream: bool) -> None:
    (first, first_tokens, _), (second, second_tokens, _) = reference
    session = f"dies-{stream}"
    tokens, holder = turn(cluster, session, first)
    assert tokens == first_tokens
    arm(cluster, holder)
    cluster.wait_idle(2)
    tokens, node = (stream_turn if stream else turn)(cluster, session, second)
    engine = cluster.procs[f"{holder}.engine"]
    assert engine.popen.wait(timeout=30) == 70, engine.tail()  # it did get the request
    assert node == other(holder)
    assert tokens == second_tokens
    restart_engine(cluster, holder)
