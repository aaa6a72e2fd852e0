"""The node's Reuse Store (Tangram §3.1-§3.3): the Tensor Mapping from fingerprints to
regions of the arena, and what an activation must load.

    activate model m  (the nodemgr's Activator)
      plan(m):  m's tensors by fingerprint (its index)
                resident -> mapped as they are (a reuse hit)
                missing  -> Stage 1: evict the cheapest unpinned tensors (eviction.py) if
                            the arena or the node's budget lacks the bytes; Stage 2: place
                            them (allocator.py: Algorithm 1, compaction if packing fails)
                every tensor of m pinned (no eviction, no move) while m is active
      the engine maps the arena, fills the missing tensors, computes on the views
      committed(m) / aborted(m);  deactivated(m) when its engine evicts it: its tensors
      stay resident ("inactive but resident") until Stage 1 or the broker takes them

Bytes of resident tensors count in the node's device ledger as this process's weights,
so the arena and every engine's KV pages share one budget (§3.3); ``release`` gives
weights back to KV by the same Stage 1 order when an engine waits for pages.
It implements ``shared.model_residency.ResidencySource`` for placement by load time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.nodemgr.reuse_store.allocator import NoRoom, place
from services.nodemgr.reuse_store.arena import Arena
from services.nodemgr.reuse_store.eviction import Candidate, choose_evictions, eviction_cost
from services.nodemgr.reuse_store.fingerprint import ModelIndex
from services.nodemgr.reuse_store.packing import Item
from services.nodemgr.reuse_store.regions import RegionList, aligned
from services.nodemgr.reuse_store.stats import AccessFrequency, StoreStats
from shared.device_ledger import DeviceLedger
from shared.model_residency import ModelResidency

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mapped:
    """One engine tensor of an activation: where it is, and whether the engine writes it."""

    name: str
    offset: int
    nbytes: int
    fill: bool


@dataclass
class _Resident:
    size: int  # aligned region size
    nbytes: int
    valid: bool  # its bytes are written (an engine committed them)


class ReuseStore:
    def __init__(self, arena: Arena, ledger: DeviceLedger | None = None,
                 dtype: str = "bfloat16", sensitivity: Callable[[str], float] = lambda model: 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.arena = arena
        self.dtype = dtype  # the engines' serving dtype, which fingerprints include
        self.regions = RegionList(arena.nbytes // 64 * 64)
        self._ledger = ledger
        self._alpha = sensitivity  # α_m of Equation 2
        self._clock = clock
        self.indexes: dict[str, ModelIndex] = {}
        self._tensors: dict[str, _Resident] = {}
        self._pins: dict[str, int] = {}
        self._loading: dict[str, set[str]] = {}  # model -> keys it must fill
        self.active: set[str] = set()  # committed models (an engine serves them)
        self.frequency = AccessFrequency()
        self.stats = StoreStats()

    # ---- indexes ------------------------------------------------------------------------
    def add_index(self, index: ModelIndex) -> None:
        self.indexes[index.model] = index

    # ---- activation ---------------------------------------------------------------------
    def plan(self, model: str) -> list[Mapped]:
        """Make room for ``model``'s missing tensors and pin all of its tensors; NoRoom
        when they cannot fit (even after evicting every unpinned tensor). Every tensor of
        the model's index, in its order."""
        idx = self.indexes[model]
        if model in self._loading or model in self.active:
            raise RuntimeError(f"{model} is already being activated or active")
        self.frequency.access(model, self._clock())
        unique = idx.unique()
        missing = {k: n for k, n in unique.items()
                   if k not in self._tensors or not self._tensors[k].valid}
        new = {k: n for k, n in missing.items() if k not in self._tensors}
        need = sum(aligned(n) for n in new.values())
        for k in unique:
            self._pins[k] = self._pins.get(k, 0) + 1
        try:
            self._make_room(need)
            self._place(new)
        except BaseException:
            self._unpin(unique)
            raise
        self._loading[model] = set(missing)
        hits = len(unique) - len(missing)
        self.stats.hits += hits
        self.stats.hit_bytes += sum(n for k, n in unique.items() if k not in missing)
        self.stats.loads += len(missing)
        return [Mapped(t.name, self.regions.find(t.key).offset,  # type: ignore[union-attr]
                       t.nbytes, t.key in missing) for t in idx.tensors]

    def committed(self, model: str, fill_seconds: float) -> None:
        """The engine filled and serves ``model``."""
        keys = self._loading.pop(model, set())
        filled = 0
        for k in keys:
            t = self._tensors[k]
            if not t.valid:
                t.valid = True
                filled += t.nbytes
        self.stats.loaded_bytes += filled
        if filled and fill_seconds > 0:
            self.stats.bandwidth.sample(filled / fill_seconds)
        self.active.add(model)

    def aborted(self, model: str) -> None:
        """The activation failed: unpin; tensors it was to fill and nobody else holds go."""
        self._loading.pop(model, None)
        self._unpin(self.indexes[model].unique())

    def deactivated(self, model: str) -> None:
        """``model``'s engine stopped serving it: its tensors stay, evictable."""
        if model in self.active:
            self.active.discard(model)
            self._unpin(self.indexes[model].unique())

    # ---- giving memory back (§3.3) ------------------------------------------------------
    def release(self, nbytes: int) -> int:
        """Evict unpinned tensors, cheapest first (Stage 1's order), until ``nbytes`` are
        freed or none is left; bytes freed (the node's KV needs them)."""
        cands = self._candidates()
        chosen = choose_evictions(cands, nbytes) or cands
        return self._evict([c.key for c in chosen])

    # ---- ResidencySource ----------------------------------------------------------------
    def residency(self) -> list[ModelResidency]:
        out = []
        for name, idx in sorted(self.indexes.items()):
            unique = idx.unique()
            resident = sum(n for k, n in unique.items()
                           if k in self._tensors and self._tensors[k].valid)
            out.append(ModelResidency(name, resident, sum(unique.values()),
                                      name in self.active))
        return out

    def load_bytes_per_s(self) -> float:
        return self.stats.bandwidth.value

    # ---- for metrics --------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values() if t.valid)

    def shared_bytes(self) -> int:
        """Bytes of resident tensors that more than one model's index names (held once,
        where private copies would hold them once per model)."""
        owners: dict[str, int] = {}
        for idx in self.indexes.values():
            for k in idx.unique():
                owners[k] = owners.get(k, 0) + 1
        return sum(t.nbytes for k, t in self._tensors.items()
                   if t.valid and owners.get(k, 0) > 1)

    def check_integrity(self) -> None:
        self.regions.check_integrity()
        assert set(self.regions.keys()) == set(self._tensors)
        assert all(v > 0 for v in self._pins.values())
        assert all(k in self._tensors for k in self._pins)

    # ---- internals ----------------------------------------------------------------------
    def _make_room(self, need: int) -> None:
        """Stage 1 (§3.2.2): evict until the arena's free bytes and the node's budget both
        cover ``need``."""
        free = self.regions.free_bytes()
        budget = self._ledger.available_bytes(weights=True) if self._ledger else need
        deficit = max(0, need - free, need - budget)
        if not deficit:
            return
        chosen = choose_evictions(self._candidates(), deficit)
        if chosen is None:
            raise NoRoom(f"{need >> 20} MiB of weights to load: the arena has "
                         f"{free >> 20} MiB free, the node's budget {budget >> 20} MiB, and "
                         "evicting every inactive tensor would not make enough room")
        self._evict([c.key for c in chosen])

    def _place(self, new: dict[str, int]) -> None:
        if not new:
            return
        need = sum(aligned(n) for n in new.values())
        if self._ledger is not None and not self._ledger.take(need, weights=True):
            raise NoRoom("the node's device budget is held by KV pages")
        started = time.perf_counter()
        try:
            movable = {k for k, t in self._tensors.items() if t.valid and k not in self._pins}
            placement = place(self.regions, [Item(k, aligned(n)) for k, n in new.items()],
                              movable)
        except NoRoom:
            if self._ledger is not None:
                self._ledger.give(need, weights=True)
            raise
        finally:
            elapsed = time.perf_counter() - started
        moved_at = time.perf_counter()
        for m in placement.moves:
            self.arena.move(m.src, m.dst, m.size)
        if placement.packed:
            self.stats.packings += 1
            self.stats.packing_seconds += elapsed
        if placement.compactions:
            self.stats.compactions += placement.compactions
            self.stats.moved_bytes += placement.moved_bytes
            self.stats.compaction_seconds += time.perf_counter() - moved_at
        for k, n in new.items():
            self._tensors[k] = _Resident(aligned(n), n, False)
            self.arena.commit(placement.offsets[k], aligned(n))

    def _candidates(self) -> list[Candidate]:
        """Unpinned resident tensors with their Equation 2 cost."""
        owners: dict[str, list[str]] = {}
        for name, idx in self.indexes.items():
            for k in idx.unique():
                owners.setdefault(k, []).append(name)
        now = self._clock()
        bw = self.load_bytes_per_s()
        return [Candidate(k, t.size, eviction_cost(
                    t.size, ((self.frequency.share(m, now), self._alpha(m))
                             for m in owners.get(k, ())), bw))
                for k, t in self._tensors.items() if k not in self._pins]

    def _evict(self, keys: list[str]) -> int:
        freed = 0
        for k in keys:
            t = self._tensors.pop(k)
            r = self.regions.release(k)
            self.arena.release(r.offset, r.size)
            freed += t.size
            self.stats.evictions += 1
            self.stats.evicted_bytes += t.nbytes
        if freed and self._ledger is not None:
            self._ledger.give(freed, weights=True)
        return freed

    def _unpin(self, keys: dict[str, int]) -> None:
        for k in keys:
            left = self._pins.get(k, 0) - 1
            if left > 0:
                self._pins[k] = left
                continue
            self._pins.pop(k, None)
            t = self._tensors.get(k)
            if t is not None and not t.valid:  # (never written: nothing to keep)
                self._evict([k])
                self.stats.evictions -= 1
                self.stats.evicted_bytes -= t.nbytes
