"""An in-memory tier that can be switched off, standing in for an unreachable S3."""

from __future__ import annotations

from services.kvstore.errors import TierUnavailable
from services.kvstore.tiers.base import Blob, TierStats
from services.kvstore.tiers.dram import DramTier


class FlakyTier(DramTier):
    name = "remote"

    def __init__(self) -> None:
        super().__init__(1 << 40)
        self.down = False
        self.puts = 0

    def _check(self) -> None:
        if self.down:
            raise TierUnavailable("remote is down")

    async def get(self, key: str) -> Blob | None:
        self._check()
        return await super().get(key)

    async def put(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        self._check()
        self.puts += 1
        return await super().put(key, blob, priority)

    async def contains(self, key: str) -> bool:
        self._check()
        return await super().contains(key)

    async def written_at(self, key: str) -> float | None:
        self._check()
        return await super().written_at(key)

    async def refresh(self, key: str) -> bool:
        self._check()
        return await super().refresh(key)

    def stats(self) -> TierStats:
        s = super().stats()
        return TierStats(
            self.name, s.entries, s.bytes_used, 0, not self.down, "down" if self.down else ""
        )
