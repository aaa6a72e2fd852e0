"""A session's KV follows it across nodes (real processes on loopback, a real SeaweedFS S3
server): turns forced onto alternating nodes with drain reuse their history pulled from
the peer, a turn that arrives while the previous one is still being saved elsewhere gets
all of it, a turn whose history is only in S3 reads it by parallel ranged GETs, and a peer
dying mid-pull leaves the output correct (recomputed). Every reused turn's tokens are
recomputation's."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.cluster.turns import TENANT, settled
from bench.harness import sync_channel
from services.engine.api_types import ChatMessage
from services.engine.model import LoadedModel, load_model
from shared.proto import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster import Cluster, start_cluster
from tests.integration.reuse.harness import USER_TURNS, reference_transcript

SESSION_TURNS = USER_TURNS  # six turns
ENGINE = {"offload.policy": "always"}  # the tiny model recomputes fast: always load
# (a chunk of the tiny model is ~16 KiB: S3 reads it in several ranges)
KVSTORE = {"chunk_tokens": 64, "s3_range_bytes": 4096}


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load_model(tiny_model, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[tuple[list[ChatMessage], list[int], str]]:
    """Each turn's messages and output tokens from a recompute-only engine."""
    return asyncio.run(reference_transcript(loaded, SESSION_TURNS))


def _body(messages: list[ChatMessage]) -> dict:
    return {
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "max_tokens": 10, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
    }


def _turn(cluster: Cluster, session: str, messages: list[ChatMessage]
          ) -> tuple[list[int], int, str]:
    """(output tokens, cached tokens, serving node) of one chat turn."""
    status, answer, headers = cluster.post_with_headers(
        "/v1/chat/completions", _body(messages), headers={"X-Session-Id": session})
    assert status == 200, (answer, cluster.logs())
    tokens = answer["choices"][0]["token_ids"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens, cached, headers.get("X-Overture-Node", "")


def _serve_only(cluster: Cluster, node: str, nodes: tuple[str, ...] = ("node0", "node1")
                ) -> None:
    """Drain every node but ``node`` (and wait until the scheduler routes to it alone)."""
    for n in nodes:
        action = "undrain" if n == node else "drain"
        status, answer = cluster.post(f"/admin/nodes/{n}/{action}", {})
        assert status == 200, answer
    deadline = time.monotonic() + 20
    while cluster.get("/readyz")[1].get("healthy_nodes") != [node]:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("follow"), tiny_model, nodes=2, s3=True,
                       engine_flags=ENGINE, kvstore_flags=KVSTORE) as c:
        yield c


@pytest.mark.slow
def test_a_turn_whose_history_is_only_in_s3_matches_recompute(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: list
) -> None:
    # A cluster of its own: the module's nodes hold these turns' blocks on their devices
    # (the other tests replay the same transcript), where the turn would find them.
    with start_cluster(tmp_path_factory.mktemp("s3only"), tiny_model, nodes=2, s3=True,
                       engine_flags=ENGINE, kvstore_flags=KVSTORE) as cluster:
        (m1, e1, _), (m2, e2, _) = reference[:2]
        _serve_only(cluster, "node0")
        tokens, _, node = _turn(cluster, "in-s3", m1)
        assert tokens == e1 and node == "node0"
        settled(cluster, "in-s3")
        with sync_channel(cluster.kvstore_addresses["node0"]) as ch:  # S3 alone has it now
            kvstore_pb2_grpc.KVStoreStub(ch).Delete(kvstore_pb2.DeleteRequest(
                session=kvstore_pb2.ManifestRef(tenant=TENANT, session_id="in-s3"),
                with_chunks=True, tiers=["dram"]), timeout=30)
        _serve_only(cluster, "node1")
        names = [f'overture_turns_total{{kv_from="{src}"}}' for src in ("s3", "peer")]
        before = [_metric(cluster.text("/metrics"), n) for n in names]
        tokens, cached, node = _turn(cluster, "in-s3", m2)
        assert node == "node1" and cached > 0, cluster.logs()
        assert tokens == e2, f"the turn from S3 differs from recomputation\n{cluster.logs()}"
        # Read from S3 by node1's kvstore, or by node0's on node1's peer request (whichever
        # answers first): either way out of S3, node0's DRAM copy being gone.
        text = cluster.text("/metrics")
        after = [_metric(text, n) for n in names]
        turns = [ln for ln in text.splitlines() if ln.startswith("overture_turns_total{")]
        assert sum(after) == sum(before) + 1, (turns, cluster.logs())


def test_turns_alternating_between_nodes_reuse_their_history(
    cluster: Cluster, reference: list
) -> None:
    served = []
    for i, (messages, expected, _text) in enumerate(reference):
        _serve_only(cluster, f"node{(i + 1) % 2}")  # node1, node0, node1, ...
        before = _metric(cluster.text("/metrics"), 'overture_turns_total{kv_from="peer"}')
        tokens, cached, node = _turn(cluster, "alternating", messages)
        served.append(node)
        assert tokens == expected, f"turn {i + 1} differs from recomputation\n{cluster.logs()}"
        if i:
            assert cached > 0, f"turn {i + 1} reused nothing\n{cluster.logs()}"
            metrics = cluster.text("/metrics")
            after = _metric(metrics, 'overture_turns_total{kv_from="peer"}')
            turns = [line for line in metrics.splitlines()
                     if line.startswith("overture_turns_total")]
            assert after == before + 1, (f"turn {i + 1} pulled nothing (cached {cached}; "
                                         f"{turns}; the scheduler's view: "
                                         f"{cluster.get('/admin/sessions/alternating')[1]}; "
                                         f"{cluster.get('/readyz')[1]})\n{cluster.logs(80)}")
    assert served == ["node1", "node0"] * 3
    status, where = cluster.get("/admin/sessions/alternating")
    assert status == 200 and where["node"] == "node0", where
    # The last pulls left the history on both nodes, and in the shared S3 tier.
    assert cluster.s3_endpoint


@pytest.mark.slow
def test_a_turn_on_another_node_while_the_save_is_in_flight_gets_it_all(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: list
) -> None:
    # node0's kvstore holds every save 1.5 s before it starts: the next turn reaches
    # node1 (and asks node0) before node0 has stored anything of the first one.
    flags = {**KVSTORE, "debug_save_delay_s": 1.5, "peer_wait_s": 10.0}
    with start_cluster(tmp_path_factory.mktemp("inflight"), tiny_model, nodes=2, s3=True,
                       engine_flags={**ENGINE, "offload.peer_lookup_timeout_s": 20.0},
                       kvstore_flags=flags) as c:
        (m1, e1, _), (m2, e2, _) = reference[0], reference[1]
        _serve_only(c, "node0")
        tokens, _, node = _turn(c, "racing", m1)
        assert node == "node0" and tokens == e1
        _serve_only(c, "node1")
        tokens, cached, node = _turn(c, "racing", m2)
        assert node == "node1" and tokens == e2, c.logs()
        # Every whole block of turn 1's prompt came from node0's save (node1's device never
        # saw it, and node0 had stored nothing when it was asked): the peer waited for the
        # save instead of answering early. (The answer's text is tokenized anew in turn 2.)
        _, answer = c.post("/v1/chat/completions", {**_body(m1), "max_tokens": 1})
        prompt1 = answer["usage"]["prompt_tokens"]
        assert cached >= prompt1 // 16 * 16 > 0, (cached, prompt1, c.logs())
        assert "pulling from peer" in c.procs["node1.kvstore"].tail(200)


@pytest.mark.slow
def test_a_peer_dying_mid_pull_leaves_the_output_correct(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: list
) -> None:
    flags = {**KVSTORE, "debug_chunk_delay_s": 0.4}  # a slow link: time to kill the peer
    with start_cluster(tmp_path_factory.mktemp("dying"), tiny_model, nodes=2,
                       engine_flags=ENGINE, kvstore_flags=flags) as c:
        for i in range(3):
            messages, expected, _ = reference[i]
            _serve_only(c, "node0")
            assert _turn(c, "dying", messages)[0] == expected
        _serve_only(c, "node1")
        messages, expected, _ = reference[3]
        result: dict = {}

        def ask() -> None:
            result["turn"] = _turn(c, "dying", messages)

        import threading

        asker = threading.Thread(target=ask)
        asker.start()
        log = c.procs["node1.kvstore"].log
        deadline = time.monotonic() + 30
        # Kill node0's kvstore once node1 has started pulling from it.
        while "peer-fetch" not in _tasks_seen(log) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.8)  # 4 chunks a layer, 0.4 s each: into the second layer
        c.kill("node0.kvstore")
        asker.join(60)
        tokens, _cached, node = result["turn"]
        assert node == "node1"
        assert tokens == expected, c.logs()
        text = log.read_text()
        # Where it stopped depends on this machine's timing; every layer from there on
        # was recomputed (and the tokens above prove the output right).
        assert re.search(r"pull from peer \S+ stopped at layer \d", text), c.logs()


def _tasks_seen(log: Path) -> str:
    """node1's kvstore logs a line when a pull starts (at INFO)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "peer-fetch" if "pulling from peer" in text else ""
