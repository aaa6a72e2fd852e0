"""A node with one engine and a catalogue of two models swaps them whole (Prism §6.2: a
request for an evicted model activates it and waits, never fails): a request for the
model the engine does not hold evicts the idle one and loads it into the same engine, and
the next request for the first model swaps back. Each answers what an engine of its model
alone answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.model_catalog import ModelEntry, write_catalog
from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.test_activation import alone, generate, wait_states


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from services.engine.model import write_demo_model

    root = tmp_path_factory.mktemp("models")
    return {name: write_demo_model(root / name, size="tiny", seed=seed)
            for name, seed in (("alpha", 1), ("beta", 2))}


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("swap")
    catalog = write_catalog(work / "models.yaml", [
        ModelEntry("alpha", str(models["alpha"])), ModelEntry("beta", str(models["beta"]))])
    with start_cluster(work, models["alpha"], models_config=catalog,
                       nodemgr_flags={"evict_idle_s": 0}) as c:
        yield c


def test_one_engine_swaps_catalogue_models_in_and_out(cluster: Cluster,
                                                      models: dict[str, Path]) -> None:
    wait_states(cluster, {"alpha": "active", "beta": "evicted"})
    assert generate(cluster, "beta") == alone(models["beta"])
    wait_states(cluster, {"alpha": "evicted", "beta": "active"})
    assert generate(cluster, "alpha") == alone(models["alpha"])
    wait_states(cluster, {"alpha": "active", "beta": "evicted"})
    log = cluster.procs["node0.nodemgr"].tail(4000)
    assert log.count("activated beta") == 1 and log.count("activated alpha") == 1
    # A model in no catalogue is still a 404, naming what the node serves.
    status, body = cluster.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404, body
