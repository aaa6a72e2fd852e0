"""Advisory prefetch on real processes (loopback, a real SeaweedFS S3 server): an advisory
for a session whose KV is on another node sends its next turn to the advised node, whose
kvstore has pulled the KV into its DRAM before the request, from the peer or, with the
peer's kvstore dead, from S3, and whose engine then copied it into free device blocks;
the turn reuses it there ("device_prefetched") with exactly the tokens of
recomputation. An invalidated advisory's next turn loads from DRAM ("local")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch

from services.engine.api_types import ChatMessage
from services.engine.model import load_model
from tests.cluster import Cluster, start_cluster
from tests.integration.cluster.test_kv_follows_session import (
    ENGINE,
    KVSTORE,
    _metric,
    _serve_only,
    _turn,
)
from tests.integration.reuse.harness import USER_TURNS, reference_transcript
from tests.s3_server import aws_keys

Transcript = list[tuple[list[ChatMessage], list[int], str]]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Transcript]:
    loaded = load_model(tiny_model, dtype=torch.float32)

    async def cases() -> dict[str, Transcript]:
        return {case: await reference_transcript(loaded, [f"({case}) {USER_TURNS[0]}",
                                                          USER_TURNS[1]])
                for case in ("peer", "s3", "inval")}

    return asyncio.run(cases())


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("advise"), tiny_model, nodes=2, s3=True,
                       engine_flags=ENGINE, kvstore_flags=KVSTORE) as c:
        yield c


def _first_turn(cluster: Cluster, session: str, messages: list[ChatMessage],
                expected: list[int]) -> None:
    """Turn 1 on node0; returns once the scheduler knows where its KV is (node0's save
    reached it with a heartbeat): an advisory then names node0 as the source."""
    located = 'overture_sessions_located'
    before = _metric(cluster.text("/metrics"), located)
    _serve_only(cluster, "node0")
    tokens, _, node = _turn(cluster, session, messages)
    assert node == "node0" and tokens == expected
    deadline = time.monotonic() + 20
    while _metric(cluster.text("/metrics"), located) <= before:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)


def _advise(cluster: Cluster, session: str) -> dict:
    status, adv = cluster.post("/v1/advisory", {"session_id": session, "model": "demo-tiny",
                                                "expected_arrival_s": 2})
    assert status == 202, adv
    return adv


def _wait_prefetched(cluster: Cluster, node: str, advisory_id: str,
                     device: bool = True) -> list[str]:
    """The nodemgr's log lines of the advisory once it reached DRAM (and the device)."""
    deadline = time.monotonic() + 30
    log = cluster.procs[f"{node}.nodemgr"]
    while True:
        lines = [line for line in log.tail(400).splitlines() if advisory_id in line]
        if any("into DRAM" in line for line in lines) and (
                not device or any("into device memory" in line for line in lines)):
            return lines
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)


def _advised_turn(cluster: Cluster, session: str, messages: list[ChatMessage],
                  expected: list[int], node: str, kv_from: str = "device_prefetched") -> None:
    metric = f'overture_turns_total{{kv_from="{kv_from}"}}'
    before = _metric(cluster.text("/metrics"), metric)
    tokens, cached, served = _turn(cluster, session, messages)
    assert served == node and tokens == expected, cluster.logs()
    assert cached > 0
    after = _metric(cluster.text("/metrics"), metric)
    assert after == before + 1, f"the turn's KV was not {kv_from}\n{cluster.logs()}"


def test_an_advisory_prefetches_from_the_peer(cluster: Cluster, reference) -> None:
    (m1, e1, _), (m2, e2, _) = reference["peer"]
    _first_turn(cluster, "adv-peer", m1, e1)
    _serve_only(cluster, "node1")
    adv = _advise(cluster, "adv-peer")
    assert adv["node"] == "node1"
    lines = _wait_prefetched(cluster, "node1", adv["advisory_id"])
    assert any("prefetched into DRAM" in line for line in lines), lines
    _advised_turn(cluster, "adv-peer", m2, e2, "node1")


def test_an_invalidated_advisory_frees_the_device_copy(cluster: Cluster, reference) -> None:
    (m1, e1, _), (m2, e2, _) = reference["inval"]
    _first_turn(cluster, "adv-inval", m1, e1)
    _serve_only(cluster, "node1")
    adv = _advise(cluster, "adv-inval")
    _wait_prefetched(cluster, "node1", adv["advisory_id"])
    status, _ = cluster.delete(f"/v1/advisory/{adv['advisory_id']}")
    assert status == 200
    # The engine frees the session's device blocks (the scheduler -> nodemgr -> engine
    # calls run in the background); its next turn loads the history from DRAM.
    deadline = time.monotonic() + 10
    while cluster.engine_status("node1").prefetch.sessions:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    assert cluster.engine_status("node1").prefetch.blocks_resident == 0
    _advised_turn(cluster, "adv-inval", m2, e2, "node1", kv_from="local")


def test_with_the_peers_kvstore_dead_it_prefetches_from_s3(cluster: Cluster, reference) -> None:
    (m1, e1, _), (m2, e2, _) = reference["s3"]
    _first_turn(cluster, "adv-s3", m1, e1)
    # Wait until node0's save of the turn is durable (its manifest is in S3), then kill
    # node0's kvstore: only S3 still has the session.
    client = boto3.client("s3", endpoint_url=cluster.s3_endpoint, region_name="us-east-1",
                          **aws_keys())
    deadline = time.monotonic() + 30
    while not any("default/adv-s3@" in o["Key"] for o in  # (a manifest per model)
                  client.list_objects_v2(Bucket="overture-kv").get("Contents", [])):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    cluster.kill("node0.kvstore")
    _serve_only(cluster, "node1")
    adv = _advise(cluster, "adv-s3")
    lines = _wait_prefetched(cluster, "node1", adv["advisory_id"])
    assert any("prefetched into DRAM" in line for line in lines), (lines, cluster.logs())
    _advised_turn(cluster, "adv-s3", m2, e2, "node1")
