"""A placement move under traffic (Prism §6.2, made whole): two models busy on one node,
an empty second node; Algorithm 1 moves one of them there while requests for both keep
coming. The target activates it first, new requests go there while the source drains,
the source evicts it once idle (asked again while busy): no request fails, and every one
answers what an engine of its model alone answers."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.proto import nodemgr_pb2, nodemgr_pb2_grpc
from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.reuse_models import PROMPT, alone, catalogue
from tests.internal import sync_channel

GEN = 4
PAGE = 16 << 10
KV_ROOM = 128 * PAGE


@pytest.fixture(scope="module")
def models(unrelated: dict[str, Path]) -> dict[str, Path]:
    return {m: unrelated[m] for m in ("alpha", "beta")}


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("migration")
    catalog = catalogue(work / "models.yaml", models, {"alpha": 5.0, "beta": 5.0})
    weights = sum(f.stat().st_size for p in models.values() for f in p.glob("*.safetensors"))
    with start_cluster(
            work, models["alpha"], nodes=2, pool_engines=1, models_config=catalog,
            node_memory=weights + 2 * KV_ROOM,
            engine_flags={"page_bytes": PAGE, "device_memory_bytes": KV_ROOM},
            scheduler_flags={"placement_interval_s": 0.5, "placement_tau": 0.0,
                             "migration_backoff_s": 0.05, "migration_attempts": 60},
            nodemgr_flags={"evict_idle_s": 3600}) as c:
        yield c


def node_models(cluster: Cluster) -> dict[str, list[str]]:
    status, body = cluster.get("/admin/nodes")
    assert status == 200, body
    return {n["node"]: sorted(n["models"]) for n in body["nodes"]}


def wait_models(cluster: Cluster, want: dict[str, list[str]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while node_models(cluster) != want:
        assert time.monotonic() < deadline, (node_models(cluster), cluster.logs())
        time.sleep(0.1)


def migrations(cluster: Cluster) -> dict[str, float]:
    text = cluster.text("/metrics")
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^overture_model_migrations_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def nodemgr(cluster: Cluster, node: str, method: str, model: str) -> nodemgr_pb2.ModelReply:
    with sync_channel(cluster.nodemgr_addresses[node]) as ch:
        stub = nodemgr_pb2_grpc.NodeManagerStub(ch)
        reply: nodemgr_pb2.ModelReply = getattr(stub, method)(
            nodemgr_pb2.ModelRequest(model=model), timeout=120)
    return reply


def test_a_model_moves_to_the_idle_node_under_traffic_with_no_failed_request(
        cluster: Cluster, models: dict[str, Path]) -> None:
    expected = {name: alone(path, GEN) for name, path in models.items()}
    # Both nodes start with alpha: make node1 empty and put beta beside alpha on node0.
    assert nodemgr(cluster, "node1", "EvictModel", "alpha").done
    assert nodemgr(cluster, "node0", "ActivateModel", "beta").done
    wait_models(cluster, {"node0": ["alpha", "beta"], "node1": []})
    assert migrations(cluster).get("done", 0) == 0  # (no traffic yet: nothing to spread)

    results: list[tuple[str, int, object]] = []
    stop = threading.Event()

    def client(model: str) -> None:
        while not stop.is_set():
            status, body = cluster.post("/v1/completions", {
                "model": model, "prompt": PROMPT, "max_tokens": GEN, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            results.append((model, status, body["choices"][0]["token_ids"]
                            if status == 200 else body))

    threads = [threading.Thread(target=client, args=(m,), daemon=True)
               for m in ("alpha", "beta", "alpha", "beta")]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while migrations(cluster).get("done", 0) < 1:
            assert time.monotonic() < deadline, (migrations(cluster), cluster.logs())
            assert all(status == 200 for _, status, _ in results), results[-3:]
            time.sleep(0.2)
        time.sleep(1.0)  # (traffic goes on after the move)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert results and all(status == 200 for _, status, _ in results), \
        [r for r in results if r[1] != 200][:3]
    assert all(tokens == expected[model] for model, _, tokens in results)
    # One of them now runs on node1 alone; the other stayed on node0.
    placed = node_models(cluster)
    assert sorted(placed["node0"] + placed["node1"]) == ["alpha", "beta"], placed
    assert len(placed["node1"]) == 1, placed
    moved = placed["node1"][0]
    assert f"evicted {moved} (placed elsewhere)" in cluster.procs["node0.nodemgr"].tail(8000)
    counts = migrations(cluster)
    assert counts.get("abandoned", 0) == 0 and counts.get("failed", 0) == 0, counts
