"""Advisories warm models (issue 46): an advisory for a session whose model is evicted
activates the model on the node its request will go to, so the request finds it active and
its TTFT holds no activation (its usage says none; a request without an advisory waits for
one, and its usage says how long). While an advisory is pending its model is kept from
eviction; once it ends (invalidated, expired, followed) the model may be evicted again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, start_cluster
from tests.integration.multimodel.reuse_models import alone, catalogue, complete, wait_states

GEN = 6


@pytest.fixture(scope="module")
def cluster(unrelated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("warming")
    catalog = catalogue(work / "models.yaml", unrelated,
                        {"alpha": 1.0, "beta": 5.0, "gamma": 2.0})
    with start_cluster(work, unrelated["alpha"], pool_engines=1, models_config=catalog,
                       nodemgr_flags={"evict_idle_s": 0}) as c:
        yield c


def test_an_advisory_activates_the_model_before_its_request_and_holds_it(
        cluster: Cluster, unrelated: dict[str, Path]) -> None:
    models = unrelated
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "evicted"})
    status, adv = cluster.post("/v1/advisory", {"session_id": "s1", "model": "beta"})
    assert status == 202 and adv["node"] == "node0", adv
    # Active before any request for it is sent.
    wait_states(cluster, {"alpha": "active", "beta": "active", "gamma": "evicted"})
    body = complete(cluster, "beta", GEN, "s1")
    assert body["choices"][0]["token_ids"] == alone(models["beta"], GEN)
    assert "model_activation_s" not in body["usage"], body["usage"]  # no activation in it

    # beta (SLO 5 s, idle) would be the one evicted for gamma; a pending advisory for it
    # keeps it, so alpha (SLO 1 s) goes. gamma's request waited for its activation.
    status, adv = cluster.post("/v1/advisory", {"session_id": "s2", "model": "beta"})
    assert status == 202, adv
    body = complete(cluster, "gamma", GEN)
    assert body["choices"][0]["token_ids"] == alone(models["gamma"], GEN)
    assert body["usage"]["model_activation_s"] > 0, body["usage"]
    wait_states(cluster, {"alpha": "evicted", "beta": "active", "gamma": "active"})

    # The advisory invalidated, beta may go again: alpha's request evicts it (loosest SLO).
    status, gone = cluster.delete(f"/v1/advisory/{adv['advisory_id']}")
    assert status == 200 and gone["deleted"], gone
    body = complete(cluster, "alpha", GEN)
    assert body["choices"][0]["token_ids"] == alone(models["alpha"], GEN)
    assert body["usage"]["model_activation_s"] > 0, body["usage"]
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "active"})
