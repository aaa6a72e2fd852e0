"""The Reuse Store under pressure, with real processes (Tangram §3.2): an arena that holds
two of three fine-tunes but not all three. The third's activation evicts an idle model
from its engine and then, by Stage 1, some of that model's own tensors; asked for again,
that model reloads what went and answers exactly what an engine of its own answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.local_cluster import free_port
from services.nodemgr.reuse_store import index_model
from services.nodemgr.reuse_store.regions import aligned
from tests.cluster import Cluster
from tests.integration.multimodel.reuse_models import alone, generate, store_cluster
from tests.integration.multimodel.reuse_models import gauges as scrape

METRICS = free_port()


@pytest.fixture(scope="module")
def cluster(fine_tunes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    models = fine_tunes
    work = tmp_path_factory.mktemp("pressure")
    idx = {m: index_model(m, models[m], "float32") for m in ("a", "b", "c")}
    two = {**idx["a"].unique(), **idx["b"].unique()}
    own_c = {k: n for k, n in idx["c"].unique().items() if k not in two}
    # a and b fit together; c's own tensors need half again what is left.
    arena = sum(aligned(n) for n in two.values()) + sum(aligned(n) for n in own_c.values()) // 2
    with store_cluster(work, models, arena // 64 * 64 + 64 * 64, METRICS) as c:
        yield c


def gauges() -> dict[str, float]:
    return scrape(METRICS)


def test_eviction_under_pressure_and_reload(cluster: Cluster,
                                            fine_tunes: dict[str, Path]) -> None:
    models = fine_tunes
    for m in ("a", "b"):
        generate(cluster, m)
    assert gauges()["reuse_evictions"] == 0
    assert generate(cluster, "c") == alone(models["c"])  # evicts a, then a's own tensors
    after_c = gauges()
    assert after_c["reuse_evictions"] > 0, cluster.logs()
    assert generate(cluster, "a") == alone(models["a"])  # reloads what was evicted
    assert gauges()["reuse_loaded_bytes"] > after_c["reuse_loaded_bytes"]
