"""A real kvstore (gRPC server on loopback, real RocksDB/S3 tiers) inside the test's loop,
an engine wired to it, and a chat transcript helper."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from services.engine.api_types import (
    ChatMessage,
    EngineStatus,
    GenerateRequest,
    SamplingParams,
)
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig, OffloadConfig
from services.engine.model import LoadedModel
from services.kvstore.config import KVStoreConfig
from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.server import SERVICE_NAME, build_store
from services.kvstore.service import KVStoreService
from shared.config import build
from shared.grpc_server import serve_grpc
from shared.proto import kvstore_pb2_grpc

CHUNK_TOKENS = 64
TENANT = "acme"


@dataclasses.dataclass
class KVStoreHandle:
    address: str
    pool_path: EnginePoolPath
    config: KVStoreConfig


def kvstore_config(port: int, ssd_path: Path | None, s3: dict | None = None) -> KVStoreConfig:
    tiers = ["dram"] + (["ssd"] if ssd_path else []) + (["s3"] if s3 else [])
    raw: dict = {
        "port": port,
        "tiers": tiers,
        "chunk_tokens": CHUNK_TOKENS,
        "dram_bytes": 1 << 26,
        "ssd_bytes": 1 << 26,
        "retry_backoff_max_s": 0.05,
        "drain_s": 10.0,
        "sweep_interval_s": 60.0,
    }
    if ssd_path:
        raw["ssd_path"] = str(ssd_path)
    if s3:
        raw["s3"] = s3
    return build(KVStoreConfig, raw)


@contextlib.asynccontextmanager
async def kvstore(config: KVStoreConfig) -> AsyncIterator[KVStoreHandle]:
    """The kvstore service as ``services.kvstore.server.run`` builds it, without signals."""
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(build_store(config, KVStoreMetrics()))
        pool_path = await stack.enter_async_context(
            EnginePoolPath(
                store,
                config.chunk_tokens,
                lease_s=config.lease_s,
                readahead_layers=config.load_readahead_layers,
                drain_s=config.drain_s,
            )
        )
        service = KVStoreService(
            pool_path.manifests, config.node_id, config.stream_window, "", pool_path
        )
        server = await stack.enter_async_context(
            serve_grpc(
                config.host,
                config.port,
                register=[lambda s: kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, s)],
                service_names=[SERVICE_NAME],
            )
        )
        yield KVStoreHandle(f"{config.host}:{server.port}", pool_path, config)


def engine_config(address: str = "", mode: str = "layerwise", **kw: object) -> EngineConfig:
    base: dict = {
        "dtype": "float32",
        "block_size": 16,
        "device_memory_bytes": 8 << 20,
        "page_bytes": 16 << 10,
        "debug_checks": True,
        "max_num_batched_tokens": 256,
    }
    base.update(kw)
    # The tests assert where reused KV came from; a loaded CI machine must not turn a
    # slow S3 existence check into "no reuse" (the production default stays short).
    offload = OffloadConfig(
        kvstore_address=address, mode=mode, policy="always", lookup_timeout_s=10.0
    )
    return EngineConfig(offload=offload, **base)


@contextlib.asynccontextmanager
async def engine(
    loaded: LoadedModel,
    address: str = "",
    attach: bool = True,
    mode: str = "layerwise",
    **kw: object,
) -> AsyncIterator[AsyncEngine]:
    """An engine; with ``address`` (and ``attach``) it is attached to that kvstore before
    it is handed out."""
    async with AsyncEngine(engine_config(address, mode, **kw), loaded=loaded) as eng:
        if address and attach and mode != "recompute":
            assert await eng.kv_connector.attach(timeout=10.0), "engine could not attach"
        yield eng


SYSTEM = (
    "You are a helpful assistant. Answer briefly and politely. The quick brown fox jumps "
    "over the lazy dog while the king counts his three daughters in a land far away."
)
USER_TURNS = [
    "Tell me a story about a robot that learns to paint.",
    "Why is the sky blue in the afternoon?",
    "What is the capital of France and why?",
    "Count from one to ten please.",
    "Once upon a time there was a king; continue.",
    "Summarise everything we said so far.",
]


def turn_request(
    messages: list[ChatMessage], session: str, n: int = 10, tenant: str = TENANT
) -> GenerateRequest:
    return GenerateRequest(
        messages=tuple(messages),
        session_id=session,
        tenant=tenant,
        sampling=SamplingParams(max_tokens=n, ignore_eos=True),
    )


async def run_turn(eng: AsyncEngine, req: GenerateRequest) -> tuple[list[int], str, int]:
    """(output token ids, text, cached_tokens) of one greedy request."""
    tokens: list[int] = []
    text = []
    cached = 0
    async for out in eng.generate(req):
        tokens.extend(out.token_ids)
        text.append(out.text)
        cached = out.cached_tokens
    return tokens, "".join(text), cached


async def reference_transcript(
    loaded: LoadedModel, turns: list[str] = USER_TURNS, session: str = "ref"
) -> list[tuple[list[ChatMessage], list[int], str]]:
    """Each turn's (messages sent, output tokens, text) from a recompute-only engine."""
    out = []
    history = [ChatMessage("system", SYSTEM)]
    async with engine(loaded, mode="recompute") as eng:
        for user in turns:
            msgs = [*history, ChatMessage("user", user)]
            tokens, text, _ = await run_turn(eng, turn_request(msgs, session))
            out.append((msgs, tokens, text))
            history = [*msgs, ChatMessage("assistant", text)]
    return out


def _unsettled(status: EngineStatus) -> int:
    """Blocks in use by anything but prefetched advised sessions."""
    p = status.reuse.prefetch
    return status.blocks_used - (p.blocks_held if p is not None else 0)


async def saves_settled(eng: AsyncEngine, timeout_s: float = 10.0) -> None:
    """Wait until no block is pinned by a save in flight (all requests have finished)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while _unsettled(await eng.status()):
        assert loop.time() < deadline, "saves did not finish"
        await asyncio.sleep(0.01)
