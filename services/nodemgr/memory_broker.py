"""The node's memory broker (Prism §5.1): one device budget (the node's device ledger,
``shared/device_ledger.py``) shared by the node's engines, pages granted on demand and
taken back from idle engines when a busy one waits for them.

Engines take pages from the ledger themselves as their KV grows (no round trip here), so
whoever needs memory now gets what is free. What the broker adds is reclaiming: an engine
that went idle keeps its committed pages (its prefix cache) until asked; when another
engine has requests waiting, every idle engine is asked to release the pages that hold no
running KV (``ShrinkKV``). Its sessions' KV is in the kvstore, so nothing is lost but a
local copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

ALL_PAGES = 1 << 40


@dataclass(frozen=True)
class EngineMemory:
    """What the broker knows of one engine of the node."""

    name: str
    running: int
    waiting: int
    committed_blocks: int


def to_reclaim(engines: Sequence[EngineMemory]) -> list[str]:
    """The engines to take pages back from now, when an engine has requests waiting: every
    other engine holding pages. ``ShrinkKV`` releases only pages without running KV, so a
    busy engine gives up its free and prefix-cached pages and keeps what it computes with;
    an idle one gives up all it holds."""
    waiting = {e.name for e in engines if e.waiting}
    if not waiting:
        return []
    return [e.name for e in engines
            if e.committed_blocks > 0 and (e.name not in waiting or len(waiting) > 1)]


class MemoryBroker:
    """Polls the engines' load every ``interval_s`` and reclaims for the waiting ones.

    A round asks every engine of the node for its Status. While ``busy()`` says the node
    has no request in any engine, none can wait for pages, and a round runs only every
    ``idle_interval_s`` (measured: eight idle engines polled ten times a second cost 17.5%
    of two cores, 10% at once a second; ``python -m bench.cluster.idle_cost``)."""

    def __init__(self, poll: Callable[[], Awaitable[list[EngineMemory]]],
                 shrink: Callable[[str, int], Awaitable[int]], interval_s: float = 0.1,
                 busy: Callable[[], bool] | None = None, idle_interval_s: float = 1.0,
                 release_weights: Callable[[], int] | None = None) -> None:
        """``release_weights``: evict some of the Reuse Store's inactive tensors (Tangram
        §3.3), asked when an engine waits and no idle engine had pages to give back: idle
        models' weights give way to KV after prefetched and cached KV, as DESIGN orders."""
        self._poll = poll
        self._shrink = shrink
        self.interval_s = interval_s
        self._busy = busy
        self.idle_interval_s = max(interval_s, idle_interval_s)
        self._release_weights = release_weights
        self.reclaimed_pages = 0
        self.released_weight_bytes = 0
        self.rounds = 0
        self._last_round = -float("inf")

    def due(self, now: float) -> bool:
        """Whether a round should run now: always while the node is busy, else once every
        ``idle_interval_s``."""
        busy = self._busy is None or self._busy()
        return busy or now - self._last_round >= self.idle_interval_s

    async def balance(self) -> int:
        """One round: pages reclaimed."""
        self.rounds += 1
        self._last_round = time.monotonic()
        engines = await self._poll()
        got = 0
        for name in to_reclaim(engines):
            pages = await self._shrink(name, ALL_PAGES)
            if pages:
                log.info("took %d KV pages back from idle engine %s", pages, name)
            got += pages
        self.reclaimed_pages += got
        if not got and self._release_weights is not None and any(e.waiting for e in engines):
            self.released_weight_bytes += self._release_weights()
        return got

    async def run(self) -> None:
        while True:
            try:
                if self.due(time.monotonic()):
                    await self.balance()
            except Exception:  # (an engine down is the registrar's to report)
                log.debug("memory broker round failed", exc_info=True)
            await asyncio.sleep(self.interval_s)
