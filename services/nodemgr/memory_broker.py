"""The node's memory broker (Prism §5.1): one device budget (the node's device ledger,
``shared/device_ledger.py``) shared by the node's engines, pages granted on demand and
taken back from idle engines when a busy one waits for them.

Engines take pages from the ledger themselves as their KV grows (no round trip here), so
whoever needs memory now gets what is free. What the broker adds is reclaiming: an engine
that went idle keeps its committed pages (its prefix cache) until asked; when another
engine has requests waiting, every idle engine is asked to release the pages that hold no
running KV (``ShrinkKV``). Its sessions' KV is in the kvstore, so nothing is lost but a
local copy.

When no pages came back, weights give way in the node's one order (``shared/give_way.py``,
as its engines report it): the Reuse Store's inactive tensors (Tangram §3.3) and idle
models' layers lent to the node's budget, then active models' layers lowest priority
first (MIRAGE §5.2, ``weight_lending.py``); lent layers come back once nothing waited for
``revert_after_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from shared.give_way import GiveWay, parse_give_way

from .weight_lending import Lender, next_lender, revert_order

log = logging.getLogger(__name__)

ALL_PAGES = 1 << 40


@dataclass(frozen=True)
class EngineMemory:
    """What the broker knows of one engine of the node."""

    name: str
    running: int
    waiting: int
    committed_blocks: int
    lending: Lender | None = None  # None: the engine cannot lend its weights (remap off)
    give_way: str = ""  # the order its engine.remap.give_way names ("": the default)


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


def give_way_of(engines: Sequence[EngineMemory]) -> GiveWay:
    """The order the node's engines report (the first that names one; else the default)."""
    named = next((e.give_way for e in engines if e.give_way), "")
    return parse_give_way(named)


class MemoryBroker:
    """Polls the engines' load every ``interval_s`` and reclaims for the waiting ones.

    A round asks every engine of the node for its Status. While ``busy()`` says the node
    has no request in any engine, none can wait for pages, and a round runs only every
    ``idle_interval_s`` (measured: eight idle engines polled ten times a second cost 17.5%
    of two cores, 10% at once a second; ``python -m bench.cluster.idle_cost``)."""

    def __init__(self, poll: Callable[[], Awaitable[list[EngineMemory]]],
                 shrink: Callable[[str, int], Awaitable[int]], interval_s: float = 0.1,
                 busy: Callable[[], bool] | None = None, idle_interval_s: float = 1.0,
                 release_weights: Callable[[], int] | None = None,
                 lend: Callable[[str, int], Awaitable[int]] | None = None,
                 revert_after_s: float = 1.0) -> None:
        """``release_weights``: evict some of the Reuse Store's inactive tensors (Tangram
        §3.3), asked when an engine waits and no idle engine had pages to give back: idle
        models' weights give way to KV after prefetched and cached KV, as DESIGN orders.
        ``lend(engine, layers)``: ask an engine to lend (< 0: take back) layers' weight
        memory to the node's budget (MIRAGE §5.2); the layers it has lent then."""
        self._poll = poll
        self._shrink = shrink
        self.interval_s = interval_s
        self._busy = busy
        self.idle_interval_s = max(interval_s, idle_interval_s)
        self._release_weights = release_weights
        self.reclaimed_pages = 0
        self.released_weight_bytes = 0
        self._lend = lend
        self.revert_after_s = revert_after_s
        self.layers_lent = 0  # lend calls that lent a layer, ever
        self.layers_taken_back = 0
        self.rounds = 0
        self._last_round = -float("inf")
        self._last_wait = -float("inf")

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
        if any(e.waiting for e in engines):
            self._last_wait = time.monotonic()
            if not got:
                await self._weights_give_way(engines)
        elif time.monotonic() - self._last_wait >= self.revert_after_s:
            await self._revert(engines)
        return got

    async def _weights_give_way(self, engines: Sequence[EngineMemory]) -> None:
        """One step of weights giving way (no pages came back): the Reuse Store's inactive
        tensors and one more layer of the first lender, in the node's give-way order."""
        order = give_way_of(engines)
        if order.idle_first and self._release_store():
            return
        lenders = [e.lending for e in engines if e.lending is not None]
        lender = next_lender(lenders, order) if self._lend is not None else None
        if lender is not None and self._lend is not None:
            before = lender.node_layers
            if await self._lend(lender.name, 1) > before:
                self.layers_lent += 1
                log.info("engine %s lent a layer's weights to the node's KV", lender.name)
                return
        if not order.idle_first:
            self._release_store()

    def _release_store(self) -> int:
        got = self._release_weights() if self._release_weights is not None else 0
        self.released_weight_bytes += got
        return got

    async def _revert(self, engines: Sequence[EngineMemory]) -> None:
        """Reversion: nothing waited for ``revert_after_s``: idle engines' cached pages are
        released, then the lenders take their layers back, the most important first, while
        the node's budget has the bytes free (running KV in them keeps them lent)."""
        if self._lend is None:
            return
        lenders = [e.lending for e in engines if e.lending is not None]
        lent = revert_order(lenders, give_way_of(engines))
        for e in engines if lent else ():  # cached KV gives way before weights: idle
            if not e.running and e.committed_blocks:  # engines' pages go first
                self.reclaimed_pages += await self._shrink(e.name, ALL_PAGES)
        for lender in lent:
            left = await self._lend(lender.name, -lender.node_layers)
            self.layers_taken_back += lender.node_layers - left

    async def run(self) -> None:
        while True:
            try:
                if self.due(time.monotonic()):
                    await self.balance()
            except Exception:  # (an engine down is the registrar's to report)
                log.debug("memory broker round failed", exc_info=True)
            await asyncio.sleep(self.interval_s)
