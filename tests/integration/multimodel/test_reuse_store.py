"""The node's Reuse Store with real processes (Tangram §3.1): two fine-tunes of one base
that share half their tensors activate into the node's two standby engines through one
weight arena. Each shared tensor is held once; each model answers exactly what an engine
of its own answers; a model evicted from its engine and asked for again maps its
still-resident tensors and loads nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.local_cluster import free_port
from services.nodemgr.reuse_store import index_model
from tests.cluster import Cluster
from tests.integration.multimodel.reuse_models import alone, generate, store_cluster
from tests.integration.multimodel.reuse_models import gauges as scrape

METRICS = free_port()


@pytest.fixture(scope="module")
def cluster(fine_tunes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    models = fine_tunes
    work = tmp_path_factory.mktemp("reuse")
    with store_cluster(work, models, 16 << 20, METRICS) as c:
        yield c


def gauges(cluster: Cluster) -> dict[str, float]:
    return scrape(METRICS)


def test_shared_tensors_are_held_once_and_answers_match(cluster: Cluster,
                                                        fine_tunes: dict[str, Path]) -> None:
    models = fine_tunes
    got = {m: generate(cluster, m) for m in ("a", "b")}
    ia, ib = (index_model(m, models[m], "float32") for m in ("a", "b"))
    shared = set(ia.unique()) & set(ib.unique())
    assert shared
    g = gauges(cluster)
    assert g["reuse_resident_bytes"] == sum({**ia.unique(), **ib.unique()}.values())
    assert g["reuse_resident_bytes"] < ia.total_bytes + ib.total_bytes
    assert g["reuse_shared_bytes"] == sum(ia.unique()[k] for k in shared)
    assert g["reuse_hits"] >= len(shared)
    for m in ("a", "b"):
        assert got[m] == alone(models[m]), m


def test_a_resident_model_comes_back_without_loading(cluster: Cluster,
                                                     fine_tunes: dict[str, Path]) -> None:
    models = fine_tunes
    for m in ("a", "b"):
        generate(cluster, m)  # (both active, whatever ran before)
    generate(cluster, "c")  # evicts a (the loosest SLO): its tensors stay resident
    before = gauges(cluster)
    assert before["reuse_loaded_bytes"] > 0
    tokens = generate(cluster, "a")  # evicts b or c, maps a's tensors again
    after = gauges(cluster)
    assert after["reuse_loaded_bytes"] == before["reuse_loaded_bytes"], cluster.logs()
    assert after["reuse_hits"] > before["reuse_hits"]
    assert tokens == alone(models["a"])
