"""The Reuse Store as a user gets it: ``overture up`` with two float models and a config
whose catalogue lists a third turns the store on by itself (no store key anywhere). A
request for the third evicts an idle model and activates through the store; the evicted
model, asked again, maps the tensors it shares with the third (reuse hits). Every answer
is the tokens a plain load of that model gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from bench.harness.up import overture_up
from shared.model_catalog import ModelEntry
from tests.cluster import Cluster
from tests.integration.multimodel.reuse_models import alone, gauges, generate


@pytest.fixture(scope="module")
def up(fine_tunes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[tuple[Cluster, int]]:
    models = fine_tunes
    work = tmp_path_factory.mktemp("up")
    entries = [ModelEntry("a", str(models["a"]), ttft_slo_s=5.0),  # (evicted first)
               ModelEntry("b", str(models["b"]), ttft_slo_s=1.0),
               ModelEntry("c", str(models["c"]), ttft_slo_s=2.0)]
    (work / "overture.yaml").write_text(yaml.safe_dump({
        "models": [asdict(e) for e in entries],
        "nodemgr": {"evict_idle_s": 0}}))
    with overture_up(work, nodes=1, cores="shared", ready_timeout=240.0, extra_args=(
            "--model", str(models["a"]), "--model", str(models["b"]),
            "--config", "overture.yaml")) as cluster:
        targets = json.loads((work / ".overture" / "prometheus-targets.json").read_text())
        nodemgr = next(t["targets"][0] for t in targets
                       if t["labels"]["service"] == "nodemgr")
        log = (work / "up-shared.log").read_text()
        assert "Reuse Store: on" in log, log[-2000:]
        yield cluster, int(nodemgr.rsplit(":", 1)[1])


def test_up_with_a_catalogue_activates_through_the_store(up: tuple[Cluster, int],
                                                          fine_tunes: dict[str, Path]) -> None:
    models = fine_tunes
    cluster, port = up
    assert generate(cluster, "a") == alone(models["a"])  # (its engine's private copy)
    assert gauges(port)["reuse_resident_bytes"] == 0
    tokens_c = generate(cluster, "c")  # evicts a (loosest SLO), c loads into the store
    first = gauges(port)
    assert first["reuse_resident_bytes"] > 0 and first["reuse_loads"] > 0, cluster.logs()
    tokens_a = generate(cluster, "a")  # evicts c (looser than b); a maps the half it
    # shares with c, still resident
    then = gauges(port)
    assert then["reuse_hits"] > first["reuse_hits"], cluster.logs()
    assert then["reuse_shared_bytes"] > 0
    assert tokens_c == alone(models["c"])
    assert tokens_a == alone(models["a"])
