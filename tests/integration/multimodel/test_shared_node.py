"""Two models on one node, an engine each, one device budget between them (Prism §5.1):
the budget fits both only when one is idle. A burst on model B takes the pages model A no
longer uses and gives them back when A's traffic returns: no restart, and both answer
exactly what they answer alone."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engine.model import write_demo_model
from shared.device_ledger import DeviceLedger
from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.reuse_models import each_alone

PAGE = 16 << 10
KV_PAGES = 64  # (1 MiB, the least an engine may reserve)
LONG = [" ".join(f"word{i} item{j}" for j in range(90)) for i in range(4)]
GEN = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return (write_demo_model(root / "alpha", size="tiny", seed=1),
            write_demo_model(root / "beta", size="tiny-deep", seed=2))


@pytest.fixture(scope="module")
def expected(models: tuple[Path, Path]) -> dict[str, tuple[list[list[int]], int]]:
    return {"alpha": each_alone(models[0], LONG, GEN), "beta": each_alone(models[1], LONG, GEN)}


@pytest.fixture(scope="module")
def cluster(models: tuple[Path, Path], expected: dict, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    budget = expected["alpha"][1] + expected["beta"][1] + KV_PAGES * PAGE
    flags = {"page_bytes": PAGE, "device_memory_bytes": KV_PAGES * PAGE}
    with start_cluster(tmp_path_factory.mktemp("two-models"), models[0],
                       more_models=(models[1],), node_memory=budget,
                       engine_flags=flags, nodemgr_flags={"broker_interval_s": 0.05}) as c:
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


def test_both_models_are_listed(cluster: Cluster) -> None:
    status, body = cluster.get("/v1/models")
    assert status == 200 and {m["id"] for m in body["data"]} == {"alpha", "beta"}


def test_bursts_take_turns_with_the_node_budget(cluster: Cluster, expected: dict,
                                                tmp_path_factory: pytest.TempPathFactory
                                                ) -> None:
    ledger = DeviceLedger(next(cluster.log_dir.parent.glob("node0.ledger")))
    try:
        def held(label: str) -> int:
            return sum(h.kv_bytes for h in ledger.holders() if h.label == label)

        assert burst(cluster, "alpha", LONG) == expected["alpha"][0]
        a_pages = held("alpha") // PAGE
        assert a_pages >= 30, cluster.logs()  # (alpha keeps its pages while idle)
        assert burst(cluster, "beta", LONG[:2]) == expected["beta"][0][:2]
        assert held("alpha") // PAGE < a_pages  # the broker took alpha's back for beta
        b_pages = held("beta") // PAGE
        assert burst(cluster, "alpha", LONG) == expected["alpha"][0]
        assert held("beta") // PAGE < b_pages  # ... and beta's back for alpha
        assert ledger.used_bytes() <= ledger.budget_bytes
        log = cluster.procs["node0.nodemgr"].tail(4000)
        assert "KV pages back from idle engine" in log
    finally:
        ledger.close()
