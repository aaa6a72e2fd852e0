"""Every service exports Prometheus metrics (what the compose ``monitoring`` profile and
the Kubernetes annotations scrape): the engine, the nodemgr and the kvstore on their
``metrics_port``, the scheduler on its public port; after a turn and an advisory, the
numbers show them."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.local_cluster import free_port
from tests.cluster import Cluster, start_cluster

PORTS = {"engine": free_port(), "nodemgr": free_port(), "kvstore": free_port()}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("metrics"), tiny_model,
                       engine_flags={"metrics_port": PORTS["engine"]},
                       nodemgr_flags={"metrics_port": PORTS["nodemgr"]},
                       kvstore_flags={"metrics_port": PORTS["kvstore"]}) as c:
        yield c


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _value(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def test_each_service_exports_what_it_did(cluster: Cluster) -> None:
    body = {"model": "demo-tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "a turn to count " * 8}]}
    for _ in range(2):
        status, _, _ = cluster.post_with_headers("/v1/chat/completions", body,
                                                 headers={"X-Session-Id": "m"})
        assert status == 200
    status, _, _ = cluster.post_with_headers(
        "/v1/advisory", {"session_id": "m", "model": "demo-tiny"}, headers={})
    assert status == 202
    deadline = time.monotonic() + 10
    while True:
        engine, nodemgr = _scrape(PORTS["engine"]), _scrape(PORTS["nodemgr"])
        kvstore, scheduler = _scrape(PORTS["kvstore"]), cluster.text("/metrics")
        if _value(nodemgr, 'overture_nodemgr_prefetch_hops_total{hop="device"') >= 1:
            break
        assert time.monotonic() < deadline, (nodemgr, cluster.logs())
        time.sleep(0.1)
    assert _value(engine, 'overture_engine_sequences{model="demo-tiny",state="running"}') == 0
    assert _value(engine, "overture_engine_prompt_tokens_total") > 0
    assert _value(engine, 'overture_engine_prompt_tokens_total{kv_from="device"') > 0
    assert _value(engine, 'overture_engine_kvstore_calls_total{call="save",') >= 1
    assert _value(nodemgr, 'overture_nodemgr_advisories_total{event="received"}') == 1
    assert _value(nodemgr, "overture_nodemgr_problem") == 0
    assert _value(kvstore, "kvstore_") > 0
    assert _value(scheduler, 'overture_generated_tokens_total{model="demo-tiny"}') == 8
