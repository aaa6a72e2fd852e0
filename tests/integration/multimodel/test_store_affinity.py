"""The Reuse Store's residency steers placement (Tangram §3.1 with §3.4, Algorithm 2),
through real heartbeats: two nodes, each with a store; model ``a`` activated on node1 and
evicted there, so node1 still holds all of its tensors and node0 none. The next request
for ``a`` (active nowhere) is activated on node1, mapping its resident tensors, and
answers exactly what an engine of its own answers."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.model_catalog import ModelEntry
from shared.proto import nodemgr_pb2, nodemgr_pb2_grpc
from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.reuse_models import alone, catalogue, generate
from tests.internal import sync_channel


@pytest.fixture(scope="module")
def cluster(fine_tunes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("store-affinity")
    catalog = catalogue(work / "models.yaml", fine_tunes, {"a": 5.0, "b": 5.0},
                        base=ModelEntry("base", str(fine_tunes["base"]), pin=True))
    with start_cluster(work, fine_tunes["base"], nodes=2, pool_engines=1,
                       models_config=catalog,
                       scheduler_flags={"placement_interval_s": 0},  # (no moves of its own)
                       nodemgr_flags={"evict_idle_s": 0, "reuse_store_bytes": 64 << 20,
                                      "weights_dtype": "float32"}) as c:
        yield c


def nodemgr(cluster: Cluster, node: str, method: str, model: str) -> bool:
    with sync_channel(cluster.nodemgr_addresses[node]) as ch:
        reply = getattr(nodemgr_pb2_grpc.NodeManagerStub(ch), method)(
            nodemgr_pb2.ModelRequest(model=model), timeout=120)
    return bool(reply.done)


def nodes(cluster: Cluster) -> dict[str, dict[str, Any]]:
    status, body = cluster.get("/admin/nodes")
    assert status == 200, body
    return {n["node"]: n for n in body["nodes"]}


def affinity(cluster: Cluster, reuse: str) -> float:
    label = f'origin="request",reuse="{reuse}"'
    m = re.search(r"^overture_affinity_activations_total\{" + label + r"\} (\S+)$",
                  cluster.text("/metrics"), re.M)
    return float(m.group(1)) if m else 0.0


def test_an_evicted_models_next_activation_goes_where_its_tensors_are(
        cluster: Cluster, fine_tunes: dict[str, Path]) -> None:
    assert nodemgr(cluster, "node1", "ActivateModel", "a")
    assert nodemgr(cluster, "node1", "EvictModel", "a")
    deadline = time.monotonic() + 30
    while True:  # node1's heartbeats say it holds all of a, inactive; node0's none of it
        n = nodes(cluster)
        held = n["node1"]["residency"].get("a", {})
        if (held.get("total_bytes") and held["resident_bytes"] == held["total_bytes"]
                and not held["active"] and "a" not in n["node1"]["models"]):
            break
        assert time.monotonic() < deadline, (n, cluster.logs())
        time.sleep(0.2)
    assert n["node0"]["residency"].get("a", {}).get("resident_bytes", 0) == 0, n["node0"]
    before = affinity(cluster, "all")
    assert generate(cluster, "a") == alone(fine_tunes["a"])
    assert affinity(cluster, "all") == before + 1
    n = nodes(cluster)
    assert "a" in n["node1"]["models"] and "a" not in n["node0"]["models"], n
    assert "activated a" not in cluster.procs["node0.nodemgr"].tail(4000)
