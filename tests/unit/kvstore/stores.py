"""Stores and tiers the kvstore's store tests share: small stores, gated and slow tiers."""

from __future__ import annotations

import asyncio

import torch

from services.kvstore.manifests import ManifestStore
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store import TieredStore
from tests.unit.kvstore.chunks import (
    kv_tensor,
)
from tests.unit.kvstore.flaky import FlakyTier


def make_store(tiers: list, **kw) -> TieredStore:
    kw.setdefault("retry_backoff_max_s", 0.02)
    kw.setdefault("drain_s", 0.5)
    return TieredStore(tiers, KVStoreMetrics(), **kw)


class GatedTier(FlakyTier):
    """A remote whose puts store the blob, then wait for ``gate`` before answering: the
    window where the object exists but its write has not been acknowledged yet."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.stored = asyncio.Event()

    async def put(self, key: str, blob, priority: int = 0) -> list[str]:
        out = await super().put(key, blob, priority)
        self.stored.set()
        await self.gate.wait()
        return out


class GatedRemote(FlakyTier):
    """A lowest tier whose chunk puts store the object, then wait for ``gate``; deletes
    wait for ``delete_gate`` before they act."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.stored = asyncio.Event(), asyncio.Event()
        self.delete_gate = asyncio.Event()
        self.delete_gate.set()
        self.deleting = asyncio.Event()

    async def put(self, key: str, blob, priority: int = 0) -> list[str]:
        out = await super().put(key, blob, priority)
        if key.startswith("c/"):
            self.stored.set()
            await self.gate.wait()
        return out

    async def delete(self, key: str) -> bool:
        self.deleting.set()
        await self.delete_gate.wait()
        return await super().delete(key)


async def wait_durable_from_scratch(s: TieredStore, m) -> None:
    s.ledger._durable.clear()  # as after a restart
    await ManifestStore(s).wait_durable(m, wait_s=1)


def version(t: torch.Tensor | None) -> str | None:
    return next((f"v{i}" for i in (1, 2) if t is not None and torch.equal(t, kv_tensor(i))),
                None if t is None else "other")
