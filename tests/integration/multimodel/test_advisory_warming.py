"""Advisories warm models (issue 46): an advisory for a session whose model is evicted
activates the model on the node its request will go to, so the request finds it active and
its TTFT holds no activation (its usage says none; a request without an advisory waits for
one, and its usage says how long). While an advisory is pending its model is kept from
eviction; once it ends (invalidated, expired, followed) the model may be evicted again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import write_demo_model
from shared.model_catalog import ModelEntry, write_catalog
from tests.cluster import Cluster, start_cluster

PROMPT = "Tell me about the overture of an opera."
GEN = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_demo_model(root / name, size="tiny", seed=seed)
            for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3))}


def alone(path: Path) -> list[int]:
    async def run() -> list[int]:
        cfg = EngineConfig(model_path=str(path), dtype="float32", device_memory_bytes=8 << 20)
        async with AsyncEngine(cfg) as eng:
            req = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=GEN,
                                                                         ignore_eos=True))
            return [t async for o in eng.generate(req) for t in o.token_ids]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("warming")
    catalog = write_catalog(work / "models.yaml", [
        ModelEntry("alpha", str(models["alpha"]), ttft_slo_s=1.0),
        ModelEntry("beta", str(models["beta"]), ttft_slo_s=5.0),
        ModelEntry("gamma", str(models["gamma"]), ttft_slo_s=2.0)])
    with start_cluster(work, models["alpha"], pool_engines=1, models_config=catalog,
                       nodemgr_flags={"evict_idle_s": 0}) as c:
        yield c


def states(cluster: Cluster) -> dict[str, str]:
    status, body = cluster.get("/v1/models")
    assert status == 200, body
    return {m["id"]: m["state"] for m in body["data"]}


def wait_states(cluster: Cluster, want: dict[str, str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while states(cluster) != want:
        assert time.monotonic() < deadline, (states(cluster), cluster.logs())
        time.sleep(0.1)


def generate(cluster: Cluster, model: str, session: str = "") -> dict[str, Any]:
    status, body = cluster.post("/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": GEN, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
        **({"session_id": session} if session else {})})
    assert status == 200, (body, cluster.logs())
    return body


def test_an_advisory_activates_the_model_before_its_request_and_holds_it(
        cluster: Cluster, models: dict[str, Path]) -> None:
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "evicted"})
    status, adv = cluster.post("/v1/advisory", {"session_id": "s1", "model": "beta"})
    assert status == 202 and adv["node"] == "node0", adv
    # Active before any request for it is sent.
    wait_states(cluster, {"alpha": "active", "beta": "active", "gamma": "evicted"})
    body = generate(cluster, "beta", "s1")
    assert body["choices"][0]["token_ids"] == alone(models["beta"])
    assert "model_activation_s" not in body["usage"], body["usage"]  # no activation in it

    # beta (SLO 5 s, idle) would be the one evicted for gamma; a pending advisory for it
    # keeps it, so alpha (SLO 1 s) goes. gamma's request waited for its activation.
    status, adv = cluster.post("/v1/advisory", {"session_id": "s2", "model": "beta"})
    assert status == 202, adv
    body = generate(cluster, "gamma")
    assert body["choices"][0]["token_ids"] == alone(models["gamma"])
    assert body["usage"]["model_activation_s"] > 0, body["usage"]
    wait_states(cluster, {"alpha": "evicted", "beta": "active", "gamma": "active"})

    # The advisory invalidated, beta may go again: alpha's request evicts it (loosest SLO).
    status, gone = cluster.delete(f"/v1/advisory/{adv['advisory_id']}")
    assert status == 200 and gone["deleted"], gone
    body = generate(cluster, "alpha")
    assert body["choices"][0]["token_ids"] == alone(models["alpha"])
    assert body["usage"]["model_activation_s"] > 0, body["usage"]
    wait_states(cluster, {"alpha": "active", "beta": "evicted", "gamma": "active"})
