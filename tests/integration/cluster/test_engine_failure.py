"""Faults on a real cluster: a node manager that goes silent leaves rotation and returns;
killing a node's engine gives 503 quickly and the scheduler drops the node."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, start_cluster


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("cluster"), tiny_model) as c:
        yield c


def wait_ready_status(cluster: Cluster, status: int) -> dict:
    deadline = time.monotonic() + 20
    while True:
        code, body = cluster.get("/readyz")
        if code == status:
            return body
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)


def test_silent_node_leaves_rotation_and_returns(cluster: Cluster) -> None:
    nodemgr = cluster.procs["node0.nodemgr"].popen
    nodemgr.send_signal(signal.SIGSTOP)  # alive but silent: no heartbeats
    try:
        body = wait_ready_status(cluster, 503)
        assert body["nodes"]["node0"]["in_rotation"] is False
        status, answer = cluster.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "no_healthy_node"
    finally:
        nodemgr.send_signal(signal.SIGCONT)
    assert wait_ready_status(cluster, 200)["healthy_nodes"] == ["node0"]
    status, _ = cluster.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, cluster.logs()


def test_killed_engine_gives_503_and_the_node_leaves(cluster: Cluster) -> None:
    status, models = cluster.get("/v1/models")
    model = models["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, _ = cluster.post("/v1/chat/completions", body)
    assert status == 200, cluster.logs()

    cluster.kill("node0.engine")
    # The client's timeout is far above the scheduler's bound: a hang would fail here.
    status, answer = cluster.post("/v1/chat/completions", body, timeout=60)
    assert status == 503, (answer, cluster.logs())
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "node0" in error["message"]

    ready = wait_ready_status(cluster, 503)
    assert ready["healthy_nodes"] == [] and "engine" in ready["nodes"]["node0"]["problem"]
    assert cluster.get("/v1/models")[1]["data"] == []
    status, _ = cluster.post("/v1/completions", {"model": model, "prompt": "hi", "stream": True})
    assert status == 503
    assert cluster.procs["node0.nodemgr"].popen.poll() is None  # it keeps reporting
