"""What KV memory each engine of the node could take now, for the node's deadline queue.

Prism §6.3 dispatches requests "up to the point where they can execute immediately without
causing queuing within the engines' local waiting queues": a request its engine cannot hold
the KV of would wait inside that engine, where the node can no longer order it, and take
pages as they free up ahead of requests the node would have served first. So the node's
queue dispatches a request only when its KV fits (``RoomPlan.fits``).

What an engine could take is its spare memory (committed pages holding no running KV:
free or prefix cache, reused before it takes more) plus what the node's device ledger
lets it take (free bytes less the others' unfilled reserves). Spare memory comes from the
engines' statuses (polled by the memory broker); the ledger is read live. A request
dispatched since counts against its engine until a status asked for after its first token
(when its KV is allocated) shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from shared.device_ledger import DeviceLedger
from shared.proto import engine_pb2


@dataclass(frozen=True)
class EngineKV:
    """One engine's KV geometry and spare memory, from its status."""

    label: str  # its model: its slot's label in the device ledger
    block_bytes: int
    block_size: int  # tokens a block holds
    spare_bytes: int  # committed, holding no running KV
    kv_bytes: int  # its whole KV budget

    @classmethod
    def from_status(cls, st: engine_pb2.EngineStatus) -> EngineKV:
        model = st.models[0] if st.models else None
        spare = max(0, st.blocks_committed - st.blocks_used) * st.block_bytes
        return cls(model.name if model else "", st.block_bytes,
                   model.block_size if model else 0, spare, st.blocks_total * st.block_bytes)


@dataclass
class _Promise:
    engine: str
    nbytes: int
    started_at: float | None = None  # when its first token came (its KV was allocated)


class KVRoom:
    def __init__(self, ledger: DeviceLedger,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ledger = ledger
        self._clock = clock
        self._engines: dict[str, EngineKV] = {}
        self._pending: dict[Hashable, _Promise] = {}

    def update(self, engines: dict[str, EngineKV], asked_at: float) -> None:
        """The statuses of the engines that answered, asked for at ``asked_at`` (this
        clock): requests that started before then are in them. An engine that did not
        answer is not held back (its requests fail fast if it is gone)."""
        self._engines = dict(engines)
        self._pending = {k: p for k, p in self._pending.items() if p.engine in engines
                         and (p.started_at is None or p.started_at >= asked_at)}

    def need_bytes(self, engine: str, tokens: int) -> int:
        """The KV bytes of ``tokens`` tokens on ``engine`` (0 while its geometry is
        unknown)."""
        e = self._engines.get(engine)
        if e is None or e.block_size <= 0:
            return 0
        return -(-max(0, tokens) // e.block_size) * e.block_bytes

    def promise(self, key: Hashable, engine: str, nbytes: int) -> None:
        """A request was dispatched to ``engine`` needing ``nbytes``."""
        if nbytes > 0:
            self._pending[key] = _Promise(engine, nbytes)

    def started(self, key: Hashable) -> None:
        """Its first token came: the next status asked for from now shows its KV."""
        p = self._pending.get(key)
        if p is not None and p.started_at is None:
            p.started_at = self._clock()

    def forget(self, key: Hashable) -> None:
        """It ended before its first token (its KV, if any, was freed)."""
        self._pending.pop(key, None)

    def plan(self) -> RoomPlan:
        """A snapshot for one round of dispatching."""
        pending: dict[str, int] = {}
        for p in self._pending.values():
            pending[p.engine] = pending.get(p.engine, 0) + p.nbytes
        # What dispatched requests need beyond their engine's spare comes from the ledger.
        owed = sum(max(0, n - self._engines[e].spare_bytes) if e in self._engines else n
                   for e, n in pending.items())
        # The most an engine could ever hold: the budget less every model's weights and
        # the others' reserves. A request needing more is not held back (it would block
        # the node's queue for good): its engine decides what to do with it.
        holders = self._ledger.holders()
        fixed = sum(h.weight_bytes for h in holders)
        reserves: dict[str, int] = {}
        for h in holders:
            reserves[h.label] = reserves.get(h.label, 0) + h.reserve_bytes
        room = self._ledger.budget_bytes - fixed
        ceiling = {e: min(kv.kv_bytes, max(room - sum(reserves.values()) + own, min(room, own)))
                   for e, kv in self._engines.items()
                   for own in (reserves.get(kv.label, 0),)}
        return RoomPlan(self._engines, pending, self._ledger.free_bytes() - owed,
                        self._ledger.unfilled_reserves(), ceiling)


class RoomPlan:
    """One round's view: ``fits`` then ``take`` for each request dispatched, ``close``
    once one did not fit (what the node's ledger frees is the waiting one's)."""

    def __init__(self, engines: dict[str, EngineKV], pending: dict[str, int], free: int,
                 unfilled: dict[str, int], ceiling: dict[str, int]) -> None:
        self._engines = engines
        self._pending = dict(pending)
        self._free = max(0, free)
        self._unfilled = dict(unfilled)
        self._ceiling = ceiling

    def fits(self, engine: str, nbytes: int) -> bool:
        e = self._engines.get(engine)
        if e is None or nbytes <= 0:
            return True  # (no status yet: nothing known to hold it back)
        if nbytes > self._ceiling.get(engine, e.kv_bytes):
            return True  # never fits: its engine decides what to do with it
        spare = self._spare(engine, e)
        return nbytes <= spare or nbytes - spare <= self._ledger_room(e)

    def take(self, engine: str, nbytes: int) -> None:
        e = self._engines.get(engine)
        if e is None or nbytes <= 0:
            return
        from_ledger = max(0, nbytes - self._spare(engine, e))
        self._pending[engine] = self._pending.get(engine, 0) + nbytes
        self._free = max(0, self._free - from_ledger)
        if e.label in self._unfilled:
            self._unfilled[e.label] = max(0, self._unfilled[e.label] - from_ledger)

    def close(self) -> None:
        """No more of the ledger's free bytes this round: only spare memory is left."""
        self._free = 0

    def _spare(self, engine: str, e: EngineKV) -> int:
        return max(0, e.spare_bytes - self._pending.get(engine, 0))

    def _ledger_room(self, e: EngineKV) -> int:
        """As ``DeviceLedger.available_bytes`` computes it for that engine's process."""
        own = self._unfilled.get(e.label, 0)
        held_back = sum(self._unfilled.values()) - own
        return max(0, self._free - held_back, min(self._free, own))
