"""Models activated on demand (Prism §5.2, §6.2): a node runs one engine with a model and
one empty engine of its pool; the catalogue lists three models. A request for a model
active nowhere activates it into the empty engine, and the next one into the engine of
the idle model with the loosest TTFT SLO, which is evicted. Every request succeeds and
answers what an engine of its model alone answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import write_demo_model
from shared.model_catalog import ModelEntry, write_catalog
from tests.cluster import Cluster, start_cluster

PROMPT = "Tell me about the overture of an opera."


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_demo_model(root / name, size="tiny", seed=seed)
            for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3))}


def alone(path: Path) -> list[int]:
    async def run() -> list[int]:
        cfg = EngineConfig(model_path=str(path), dtype="float32", device_memory_bytes=8 << 20)
        async with AsyncEngine(cfg) as eng:
            req = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=8,
                                                                         ignore_eos=True))
            return [t async for o in eng.generate(req) for t in o.token_ids]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("activation")
    catalog = write_catalog(work / "models.yaml", [
        ModelEntry("alpha", str(models["alpha"]), ttft_slo_s=1.0),
        ModelEntry("beta", str(models["beta"]), ttft_slo_s=5.0),
        ModelEntry("gamma", str(models["gamma"]), ttft_slo_s=2.0),
        ModelEntry("broken", str(work / "no-such-model"))])
    with start_cluster(work, models["alpha"], pool_engines=1, models_config=catalog,
                       nodemgr_flags={"evict_idle_s": 0}) as c:
        yield c


def states(cluster: Cluster) -> dict[str, str]:
    status, body = cluster.get("/v1/models")
    assert status == 200, body
    return {m["id"]: m["state"] for m in body["data"]}


def wait_states(cluster: Cluster, want: dict[str, str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while states(cluster) != want:
        assert time.monotonic() < deadline, (states(cluster), cluster.logs())
        time.sleep(0.1)


def generate(cluster: Cluster, model: str) -> list[int]:
    status, body = cluster.post("/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, (body, cluster.logs())
    return body["choices"][0]["token_ids"]


def test_models_are_activated_on_their_first_request(cluster: Cluster,
                                                     models: dict[str, Path]) -> None:
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
        cluster: Cluster, models: dict[str, Path]) -> None:
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
