"""What the multi-model integration tests share: their demo models (three unrelated ones,
or fine-tunes of one base sharing half their tensors), a model's answer from an engine of
its own, a completion through the cluster, the models' states, a catalogue, and the
nodemgr's reuse gauges."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import write_demo_model
from services.engine.model_slot import weight_bytes
from shared.model_catalog import ModelEntry, write_catalog
from tests.cluster import Cluster, start_cluster

PROMPT = "Tell me about the overture of an opera."
GEN = 8


def write_models(root: Path) -> dict[str, Path]:
    """``base`` (private, for the node's first engine) and fine-tunes ``a``, ``b``, ``c``
    of another base, each sharing half its tensor bytes with it."""
    out = {"base": write_demo_model(root / "base", size="tiny", seed=9)}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        out[name] = write_demo_model(root / name, size="tiny", seed=seed, base_seed=0,
                                     share=0.5)
    return out


def write_unrelated(root: Path) -> dict[str, Path]:
    """Three tiny models sharing nothing: ``alpha``, ``beta``, ``gamma``."""
    return {name: write_demo_model(root / name, size="tiny", seed=seed)
            for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3))}


def catalogue(path: Path, models: dict[str, Path], slos: dict[str, float],
              **extra: ModelEntry) -> Path:
    """A catalogue of ``extra``'s entries, then ``models`` (in ``slos``' order) with their
    TTFT SLOs."""
    return write_catalog(path, list(extra.values()) + [
        ModelEntry(m, str(models[m]), ttft_slo_s=s) for m, s in slos.items()])


@contextlib.contextmanager
def store_cluster(work: Path, models: dict[str, Path], arena_bytes: int,
                  metrics_port: int) -> Iterator[Cluster]:
    """One node with a Reuse Store of ``arena_bytes``: ``base`` pinned in its first engine,
    two standby engines for the fine-tunes (``a`` the loosest SLO, evicted first)."""
    catalog = catalogue(work / "models.yaml", models, {"a": 5.0, "b": 1.0, "c": 1.0},
                        base=ModelEntry("base", str(models["base"]), pin=True))
    with start_cluster(work, models["base"], pool_engines=2, models_config=catalog,
                       nodemgr_flags={"evict_idle_s": 0, "reuse_store_bytes": arena_bytes,
                                      "weights_dtype": "float32",
                                      "metrics_port": metrics_port}) as c:
        yield c


def alone(path: Path, gen: int = GEN) -> list[int]:
    async def run() -> list[int]:
        cfg = EngineConfig(model_path=str(path), dtype="float32", device_memory_bytes=8 << 20)
        async with AsyncEngine(cfg) as eng:
            req = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=gen,
                                                                         ignore_eos=True))
            return [t async for o in eng.generate(req) for t in o.token_ids]
    return asyncio.run(run())


def complete(cluster: Cluster, model: str, gen: int = GEN, session: str = "") -> dict[str, Any]:
    """The completion's body (200 asserted)."""
    status, body = cluster.post("/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": gen, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
        **({"session_id": session} if session else {})})
    assert status == 200, (body, cluster.logs())
    return body


def generate(cluster: Cluster, model: str, gen: int = GEN) -> list[int]:
    tokens: list[int] = complete(cluster, model, gen)["choices"][0]["token_ids"]
    return tokens


def states(cluster: Cluster) -> dict[str, str]:
    status, body = cluster.get("/v1/models")
    assert status == 200, body
    return {m["id"]: m["state"] for m in body["data"]}


def wait_states(cluster: Cluster, want: dict[str, str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while states(cluster) != want:
        assert time.monotonic() < deadline, (states(cluster), cluster.logs())
        time.sleep(0.1)


def gauges(port: int) -> dict[str, float]:
    """The nodemgr's ``overture_nodemgr_reuse_*`` gauges, by name without the prefix."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0].removeprefix("overture_nodemgr_"):
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("overture_nodemgr_reuse_")}


def each_alone(path: Path, prompts: list[str], gen: int) -> tuple[list[list[int]], int]:
    """Each prompt's ``gen`` greedy tokens from an engine of its own; the weights' bytes."""
    async def run() -> tuple[list[list[int]], int]:
        cfg = EngineConfig(model_path=str(path), dtype="float32", device_memory_bytes=8 << 20)
        async with AsyncEngine(cfg) as eng:
            out = []
            for p in prompts:
                req = GenerateRequest(prompt=p, sampling=SamplingParams(
                    max_tokens=gen, ignore_eos=True))
                out.append([t async for o in eng.generate(req) for t in o.token_ids])
            return out, weight_bytes(eng.loaded.model)
    return asyncio.run(run())
