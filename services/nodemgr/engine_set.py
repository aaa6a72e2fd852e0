"""The node's engines, one per model it serves: as one for registration and heartbeats
(models listed together, load added up), and one by one for requests and advisories
(each goes to the engine of its model).

Each engine numbers its session saves itself, so each has its own watermark of saves the
scheduler acknowledged (``acked``).
"""

from __future__ import annotations

import asyncio
import dataclasses

from services.nodemgr import wire
from services.nodemgr.engine_link import EngineLink, EngineUnavailable
from shared.proto import common_pb2, engine_pb2


class UnknownModel(LookupError):
    """No engine of this node serves the model."""


class EngineSet:
    def __init__(self, addresses: list[str], status_timeout_s: float,
                 shared_budget: int = 0) -> None:
        """``shared_budget``: the node's device ledger's budget, which its engines share
        (0: each engine's own budget adds up)."""
        if not addresses:
            raise ValueError("a node needs at least one engine")
        self.links = [EngineLink(a, status_timeout_s) for a in addresses]
        self._acked = [0] * len(self.links)
        self._served: list[tuple[str, ...]] = [()] * len(self.links)  # model names per link
        self._known = False  # whether a status has told what each engine serves
        self.shared_budget = shared_budget
        self._fingerprints: dict[str, str] = {}
        self.last: wire.EngineSnapshot | None = None  # the newest status (metrics)

    @property
    def address(self) -> str:
        return ", ".join(link.address for link in self.links)

    def for_model(self, model: str) -> EngineLink:
        """The engine serving ``model`` ("" = the node's first engine with a model)."""
        if not model:
            busy = [link for link, names in zip(self.links, self._served, strict=True)
                    if names]
            return busy[0] if busy else self.links[0]
        for link, names in zip(self.links, self._served, strict=True):
            if model in names:
                return link
        if len(self.links) == 1 and not self._known:  # (it answers NOT_FOUND itself)
            return self.links[0]
        raise UnknownModel(model)

    def served(self) -> list[str]:
        """The names of the models the node's engines serve (as of the last status)."""
        return [name for names in self._served for name in names]

    async def status(self) -> wire.EngineSnapshot:
        """Every engine's status, added up; raises EngineUnavailable if one does not
        answer (the node cannot serve all it registered)."""
        parts = await asyncio.gather(*(link.status(acked) for link, acked
                                       in zip(self.links, self._acked, strict=True)))
        self._served = [tuple(m.name for m in p.models) for p in parts]
        self._known = True
        self._fingerprints = {m.name: m.fingerprint for p in parts for m in p.models}
        snap = merge(list(parts))
        self.last = snap
        if self.shared_budget:
            snap = dataclasses.replace(snap, device_budget_bytes=self.shared_budget)
        return snap

    def fingerprint(self, model: str) -> str:
        """The fingerprint of a model served here ("": the first one's; "" if unknown)."""
        if not model:
            return next(iter(self._fingerprints.values()), "")
        return self._fingerprints.get(model, "")

    def acked(self, snap: wire.EngineSnapshot) -> None:
        """The scheduler took ``snap``'s saves: do not report them again."""
        for i, part in enumerate(snap.parts or (snap,)):
            self._acked[i] = max(self._acked[i], part.last_saved)

    async def raw_status(self) -> engine_pb2.EngineStatus:
        return await self.links[0].raw_status()

    async def wait_ready(self, wait_s: float, standby: bool = False) -> wire.EngineSnapshot:
        """Every engine answers (and serves a model, unless the node keeps ``standby``
        engines: model-less ones that catalogue models are activated into)."""
        await asyncio.gather(*(link.wait_ready(wait_s, need_model=not standby)
                               for link in self.links))
        return await self.status()

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links))


def merge(parts: list[wire.EngineSnapshot]) -> wire.EngineSnapshot:
    if len(parts) == 1:
        return dataclasses.replace(parts[0], parts=(parts[0],))
    return wire.EngineSnapshot(
        models=tuple(m for p in parts for m in p.models),
        running=sum(p.running for p in parts),
        waiting=sum(p.waiting for p in parts),
        blocks_free=sum(p.blocks_free for p in parts),
        blocks_total=sum(p.blocks_total for p in parts),
        saved=tuple(s for p in parts for s in p.saved),
        queue_delay_s=max(p.queue_delay_s for p in parts),
        step_running_s=max(p.step_running_s for p in parts),
        prefetch=_merge_prefetch([p.prefetch for p in parts if p.prefetch is not None]),
        parts=tuple(parts),
        device_budget_bytes=sum(p.device_budget_bytes for p in parts),
    )


def _merge_prefetch(counters: list[common_pb2.PrefetchCounters]
                    ) -> common_pb2.PrefetchCounters | None:
    if not counters:
        return None
    depth = max(len(c.purged_blocks_by_layer) for c in counters)
    by_layer = [sum(c.purged_blocks_by_layer[i] for c in counters
                    if i < len(c.purged_blocks_by_layer)) for i in range(depth)]
    return common_pb2.PrefetchCounters(
        loaded_bytes=sum(c.loaded_bytes for c in counters),
        wasted_bytes=sum(c.wasted_bytes for c in counters),
        purged_blocks_by_layer=by_layer,
        sessions=sum(c.sessions for c in counters),
        blocks_resident=sum(c.blocks_resident for c in counters))


__all__ = ["EngineSet", "EngineUnavailable", "UnknownModel", "merge"]
