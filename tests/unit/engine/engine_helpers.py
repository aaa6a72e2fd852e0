"""The in-process AsyncEngine on the tiny demo model in float32, for the engine's unit
tests: a small config and request helpers (the ``loaded`` model fixture is in conftest)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from services.engine.api_types import GenerateOutput, GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.model import LoadedModel

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "What is the capital of France?",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "a",
    "Tell me a story about a robot that learns to paint, in great detail please.",
    "Why is the sky blue?",
]


def config(**kw: object) -> EngineConfig:
    base = {
        "dtype": "float32",
        "device_memory_bytes": 4 << 20,
        "page_bytes": 16 << 10,
        "debug_checks": True,
    }
    base.update(kw)
    return EngineConfig(**base)


@contextlib.asynccontextmanager
async def engine(loaded: LoadedModel, **kw: object) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(config(**kw), loaded=loaded) as eng:
        yield eng


def greedy(prompt: str, n: int = 12, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        prompt=prompt, sampling=SamplingParams(max_tokens=n, ignore_eos=True), **kw
    )


async def collect(eng: AsyncEngine, req: GenerateRequest) -> list[GenerateOutput]:
    return [o async for o in eng.generate(req)]


def tokens(outs: list[GenerateOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def idle(eng: AsyncEngine) -> None:
    st = await eng.status()
    assert (st.running, st.waiting, st.blocks_used) == (0, 0, 0)
    assert st.blocks_free + st.blocks_used + st.blocks_evictable == st.blocks_total
    await eng.check_integrity()
