"""Models activated on demand (Prism §5.2, §6.2): a node runs one engine with a model and
one empty engine of its pool; the catalogue lists three models. A request for a model
active nowhere activates it into the empty engine, and the next one into the engine of
the idle model with the loosest TTFT SLO, which is evicted. Every request succeeds and
answers what an engine of its model alone answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.model_catalog import ModelEntry
from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.reuse_models import (
    PROMPT,
    alone,
    catalogue,
    generate,
    states,
    wait_states,
)


@pytest.fixture(scope="module")
def cluster(unrelated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work, models = tmp_path_factory.mktemp("activation"), unrelated
    catalog = catalogue(work / "models.yaml", models, {"alpha": 1.0, "beta": 5.0, "gamma": 2.0},
                        broken=ModelEntry("broken", str(work / "no-such-model")))
    with start_cluster(work, models["alpha"], pool_engines=1, models_config=catalog,
                       nodemgr_flags={"evict_idle_s": 0}) as c:
        yield c


def test_models_are_activated_on_their_first_request(cluster: Cluster,
                                                     unrelated: dict[str, Path]) -> None:
    models = unrelated
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "evicted",
                          "broken": "evicted"})
    assert generate(cluster, "beta") == alone(models["beta"])  # into the empty engine
    wait_states(cluster, {"alpha": "active", "beta": "active", "gamma": "evicted",
                          "broken": "evicted"})
    # No empty engine left: beta (idle, SLO 5 s) goes before alpha (SLO 1 s).
    assert generate(cluster, "gamma") == alone(models["gamma"])
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "active",
                          "broken": "evicted"})
    assert generate(cluster, "alpha") == alone(models["alpha"])
    log = cluster.procs["node0.nodemgr"].tail(4000)
    assert "activated beta" in log and "evicted beta" in log
    status, body = cluster.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404, body
    # A catalogue entry whose folder is missing: a server error, and nothing evicted for it.
    status, body = cluster.post("/v1/completions", {"model": "broken", "prompt": "x"})
    assert status == 500 and body["error"]["message"], body
    assert states(cluster)["alpha"] == "active" and states(cluster)["gamma"] == "active"


def test_an_advisory_for_an_evicted_model_activates_it_before_its_request(
        cluster: Cluster, unrelated: dict[str, Path]) -> None:
    models = unrelated
    """The advisory is the earliest sign of a request: it activates the model (Prism §6.2,
    on the node a request would pick) and the request then finds it loaded."""
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "active",
                          "broken": "evicted"})
    status, body = cluster.post("/v1/advisory", {"session_id": "adv-1", "model": "beta"})
    assert status == 202 and body["node"] == "node0", body
    # gamma (idle, SLO 2 s) makes room, not alpha (SLO 1 s); no request has come for beta.
    wait_states(cluster, {"alpha": "active", "beta": "active", "gamma": "evicted",
                          "broken": "evicted"})
    activations = cluster.procs["node0.nodemgr"].tail(4000).count("activated beta")
    status, body = cluster.post("/v1/completions", {
        "model": "beta", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "session_id": "adv-1"})
    assert status == 200, (body, cluster.logs())
    assert body["choices"][0]["token_ids"] == alone(models["beta"])
    assert cluster.procs["node0.nodemgr"].tail(4000).count("activated beta") == activations
    # An advisory for a model that is nowhere in the catalogue is still a 404.
    status, body = cluster.post("/v1/advisory", {"session_id": "adv-2", "model": "nope"})
    assert status == 404, body
