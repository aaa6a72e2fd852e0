"""The cluster's internal endpoints on real processes: a caller without the cluster's
secret cannot register a node, beat for one, read or delete KV, or generate on an engine;
health checks stay open; a service without a secret (and not told to run insecure on
loopback) does not start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.cluster_config import SECRET_ENV
from shared.proto import (
    common_pb2,
    engine_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    nodemgr_pb2,
    nodemgr_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.cluster import REPO, Cluster, start_cluster
from tests.internal import sync_channel


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("auth"), tiny_model) as c:
        yield c


def _refused(call, request) -> None:
    with pytest.raises(grpc.RpcError) as e:
        result = call(request, timeout=5)
        if hasattr(result, "__next__"):  # a stream: the refusal comes with its first read
            next(result)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value


def test_an_outsider_is_refused_everywhere_but_health(cluster: Cluster) -> None:
    ref = kvstore_pb2.ManifestRef(tenant="default", session_id="s")
    addresses = [cluster.scheduler_grpc, cluster.kvstore_addresses["node0"],
                 cluster.engine_addresses["node0"], cluster.nodemgr_addresses["node0"]]
    for address in addresses:  # (plain channels: no token)
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(cluster.scheduler_grpc) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        _refused(stub.RegisterNode, scheduler_pb2.RegisterNodeRequest(
            node_id="forged", address="127.0.0.1:1", kvstore_address="127.0.0.1:2"))
        _refused(stub.Heartbeat, iter([scheduler_pb2.HeartbeatMsg(node_id="node0")]))
    with grpc.insecure_channel(cluster.kvstore_addresses["node0"]) as ch:
        kv = kvstore_pb2_grpc.KVStoreStub(ch)
        _refused(kv.GetManifest, ref)
        _refused(kv.GetChunks, kvstore_pb2.GetChunksRequest(session=ref))
        _refused(kv.Delete, kvstore_pb2.DeleteRequest(session=ref))
        _refused(kv.ListSessions, kvstore_pb2.ListSessionsRequest())  # (names tenants)
    with grpc.insecure_channel(cluster.engine_addresses["node0"]) as ch:
        _refused(engine_pb2_grpc.EngineStub(ch).Generate,
                 common_pb2.GenerateRequest(request_id="x", tenant="default"))
    with grpc.insecure_channel(cluster.nodemgr_addresses["node0"]) as ch:
        nm = nodemgr_pb2_grpc.NodeManagerStub(ch)
        _refused(nm.Advise, nodemgr_pb2.AdviseRequest(advisory_id="a", session_id="s"))
    # The forged node never joined; the members' own traffic still works.
    status, ready = cluster.get("/readyz")
    assert status == 200 and "forged" not in str(ready)
    with sync_channel(cluster.kvstore_addresses["node0"]) as ch:
        assert not kvstore_pb2_grpc.KVStoreStub(ch).GetManifest(ref, timeout=5).found
    status, body = cluster.post("/v1/chat/completions", {
        "model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2})
    assert status == 200, body


def test_a_service_without_a_secret_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERTURE_CLUSTER__")}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, "-m", "services.kvstore", "--port", "0"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2 and "no cluster secret" in run.stderr + run.stdout, run
    env["OVERTURE_CLUSTER__INSECURE"] = "true"
    run = subprocess.run([sys.executable, "-m", "services.kvstore", "--host", "0.0.0.0",
                          "--port", "0"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert run.returncode == 2 and "loopback" in run.stderr + run.stdout, run
    assert SECRET_ENV not in env
