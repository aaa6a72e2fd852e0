"""What the Reuse Store's integration tests share: fine-tunes of one base sharing half
their tensors, a model's answer from an engine of its own, a completion through the
cluster, and the nodemgr's reuse gauges."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import write_demo_model
from tests.cluster import Cluster

PROMPT = "Tell me about the overture of an opera."


def write_models(root: Path) -> dict[str, Path]:
    """``base`` (private, for the node's first engine) and fine-tunes ``a``, ``b``, ``c``
    of another base, each sharing half its tensor bytes with it."""
    out = {"base": write_demo_model(root / "base", size="tiny", seed=9)}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        out[name] = write_demo_model(root / name, size="tiny", seed=seed, base_seed=0,
                                     share=0.5)
    return out


def alone(path: Path) -> list[int]:
    async def run() -> list[int]:
        cfg = EngineConfig(model_path=str(path), dtype="float32", device_memory_bytes=8 << 20)
        async with AsyncEngine(cfg) as eng:
            req = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=8,
                                                                         ignore_eos=True))
            return [t async for o in eng.generate(req) for t in o.token_ids]
    return asyncio.run(run())


def generate(cluster: Cluster, model: str) -> list[int]:
    status, body = cluster.post("/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, (body, cluster.logs())
    return body["choices"][0]["token_ids"]


def gauges(port: int) -> dict[str, float]:
    """The nodemgr's ``overture_nodemgr_reuse_*`` gauges, by name without the prefix."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0].removeprefix("overture_nodemgr_"):
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("overture_nodemgr_reuse_")}
