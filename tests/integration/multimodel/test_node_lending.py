"""MIRAGE §5.2 across a node, end to end: two models on one device budget; a burst on
``beta`` binds on KV while ``alpha`` idles; the nodemgr's broker asks alpha's engine to lend
a layer's weight memory to the node's budget (``ShrinkKV`` with ``lend_layers``), beta's
burst completes with its own tokens, and after it the weights are back in the ledger."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.device_ledger import DeviceLedger
from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.reuse_models import each_alone

PAGE = 16 << 10
LONG = [" ".join(f"word{i} item{j}" for j in range(200)) for i in range(4)]
GEN = 8


@pytest.fixture(scope="module")
def expected(unrelated: dict[str, Path]) -> dict[str, tuple[list[list[int]], int]]:
    return {name: each_alone(unrelated[name], LONG, GEN) for name in ("alpha", "beta")}


@pytest.fixture(scope="module")
def cluster(unrelated: dict[str, Path], expected: dict,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # KV room for about two of the four long prompts (Prism's set-up: each pool is that
    # room): the burst binds on KV, and beta's pool grows into what alpha lends
    room = 64 * PAGE  # (the least an engine's pool may be)
    budget = expected["alpha"][1] + expected["beta"][1] + room
    flags = {"page_bytes": PAGE, "device_memory_bytes": room, "remap.enabled": "true",
             "remap.capped": "false", "remap.max_fraction": 0.75,
             "remap.node_grace_s": 10.0}  # (beta does not lend its own: the node's alone)
    with start_cluster(tmp_path_factory.mktemp("lending"), unrelated["alpha"],
                       more_models=(unrelated["beta"],), node_memory=budget,
                       engine_flags=flags, nodemgr_flags={"broker_interval_s": 0.05,
                                                          "lend_revert_after_s": 0.3}) as c:
        yield c


def burst(cluster: Cluster, model: str, prompts: list[str]) -> list[list[int]]:
    def one(p: str) -> list[int]:
        status, body = cluster.post("/v1/completions", {
            "model": model, "prompt": p, "max_tokens": GEN, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert status == 200, (body, cluster.logs())
        return body["choices"][0]["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_an_idle_model_lends_a_layer_for_a_burst_and_takes_it_back(
        cluster: Cluster, expected: dict) -> None:
    ledger = DeviceLedger(next(cluster.log_dir.parent.glob("node0.ledger")))
    try:
        def weights(label: str) -> int:
            return sum(h.weight_bytes for h in ledger.holders() if h.label == label)

        full = weights("alpha")
        assert full == expected["alpha"][1]
        assert burst(cluster, "beta", LONG) == expected["beta"][0]
        log = cluster.procs["node0.nodemgr"].tail(8000)
        assert "lent a layer's weights to the node's KV" in log, cluster.logs()
        deadline = time.monotonic() + 30.0  # (bounded: the broker's rounds revert)
        while weights("alpha") != full and time.monotonic() < deadline:
            time.sleep(0.1)
        assert weights("alpha") == full  # reversion: nothing left lent after the burst
        # the lender's own tokens are unchanged (its layers resident again, or streamed)
        assert burst(cluster, "alpha", LONG[:2]) == expected["alpha"][0][:2]
        assert ledger.used_bytes() <= ledger.budget_bytes
    finally:
        ledger.close()
