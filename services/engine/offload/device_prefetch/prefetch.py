"""``DevicePrefetch``: the book of advised sessions whose KV is copied into free device
blocks, filled every step, settled when its loads end, given back under pressure (the
rules are in this package's docstring). Worker thread only.

    add(order) / end(session)      orders from the event loop (through the worker inbox)
    begin_step()                   settle ended loads, expire advisories, fill free blocks
    admitted(seq)                  a request came: its advisory is followed
    reclaimable() / reclaim(n)     the allocator's ``Reclaimer`` (running requests first)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from typing import Protocol

from services.engine.api_types import PrefetchStats
from services.engine.kvcache.block_tables import BlockTables
from services.engine.layer_readiness import LayerReadiness
from services.engine.offload.device_prefetch.orders import (
    DEVICE_PARTIAL,
    DEVICE_PREFETCHED,
    EXPIRED,
    FOLLOWED,
    INVALIDATED,
    LAYERS,
    REPLACED,
    SESSIONS,
    Advised,
    Grant,
    PrefetchOrder,
)
from services.engine.offload.device_prefetch.purge import Purger
from services.engine.offload.jobs import LoadJob
from services.engine.offload.transport import KVTransport
from services.engine.reuse_plan import SKIP, ReusePlan
from services.engine.sequence import Sequence
from shared.session_key import SessionKey

log = logging.getLogger(__name__)


class RequestDemand(Protocol):
    """What the requests in the engine want (the engine's ``Scheduler``)."""

    def blocks_wanted_next_step(self) -> int:
        """Free blocks running requests and the head of the queue may take next step."""
        ...

    def sessions(self) -> Collection[SessionKey]:
        """The sessions with a request in the engine now."""
        ...


class LoadWatch(Protocol):
    """Told when a session's load into the device starts and when it is settled (its
    blocks indexed): the event loop's ``PrefetchJoins``. Called on the worker thread."""

    def started(self, first_hash: bytes) -> None: ...

    def settled(self, first_hash: bytes) -> None: ...


class DevicePrefetch:
    def __init__(self, kv: BlockTables, block_bytes: int, transport: KVTransport,
                 demand: RequestDemand, *, watch: LoadWatch | None = None,
                 clock: Callable[[], float] = time.monotonic, cooperative: bool = True,
                 purge_order: str = LAYERS) -> None:
        self.kv = kv
        self.blocks = kv.blocks
        self.block_bytes = block_bytes
        self.transport = transport
        self.demand = demand
        self.watch = watch
        self.clock = clock
        # Ablations (Symphony §4.5): without cooperation prefetched blocks are never given
        # back to running requests (the core then wires no reclaimer) nor kept out of
        # their next step's way; ``SESSIONS`` fills and purges whole sessions (least
        # recently advised first) instead of lower layers of every session before higher
        # layers of any.
        self.cooperative = cooperative
        self.purge_order = purge_order
        self.purger = Purger(kv.blocks, kv.num_layers, purge_order)
        self.sessions: dict[SessionKey, Advised] = {}
        self.loaded_bytes = 0
        self.wasted_bytes = 0
        self.outcomes: dict[str, int] = {}
        self._retiring: list[Advised] = []  # replaced while loading: settled, then gone

    @property
    def purged_by_layer(self) -> list[int]:
        return self.purger.purged_by_layer

    # ---- orders from the event loop -----------------------------------------------------
    def add(self, order: PrefetchOrder) -> None:
        """Prefetch ``order``'s session (again: an advisory for a known session renews it;
        one with another sequence replaces it)."""
        now = self.clock()
        plan = order.plan
        n = min(len(order.hashes), plan.end_block) if plan.first_block == 0 else 0
        if n == 0:
            self._release_lease(plan.lease_id)
            return
        order = dataclasses.replace(order, hashes=order.hashes[:n])
        old = self.sessions.get(order.session)
        if old is not None and not old.retire and old.hashes == order.hashes:
            # Renewed: the old spans stay right (later loads search the tiers, no lease).
            self._release_lease(plan.lease_id)
            old.advised_at, old.expires_at = now, now + order.ttl_s
            old.order = dataclasses.replace(order, plan=old.order.plan)
            return
        if old is not None:
            self._retire(old, REPLACED)
            if old.loading is not None:  # it leaves once its load has ended
                self._retiring.append(old)
        self.sessions[order.session] = Advised(order, now, now + order.ttl_s)

    def end(self, session: SessionKey, expired: bool = False) -> bool:
        """The advisory ended unfollowed: invalidated (the session's blocks are freed at
        once) or ``expired`` (they become the first to purge); whether it was known."""
        s = self.sessions.get(session)
        if s is None or s.retire:
            return False
        self._retire(s, EXPIRED if expired else INVALIDATED)
        return True

    # ---- each step ----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Settle ended loads, expire unfollowed advisories, then fill free blocks."""
        now = self.clock()
        for s in [*self._retiring, *self.sessions.values()]:
            if s.loading is not None and s.loading.finished:
                self._settle(s)
            if not s.retire and now >= s.expires_at:
                self._retire(s, EXPIRED)
        self._retiring = [s for s in self._retiring if s.loading is not None]
        self.fill()

    def admitted(self, seq: Sequence) -> None:
        """``seq`` was admitted; if it is of an advised session and on that session's blocks
        (found by content hash, as any reuse), the advisory is followed (its blocks are the
        request's now) and ``seq`` is labelled with how much of it was there."""
        s = self.sessions.get(seq.session)
        if s is None or s.retire:
            return
        if s.held and seq.block_tables[0] and seq.block_tables[0][0] == s.held[0][0]:
            whole = len(s.held) == self.kv.num_layers and not seq.offload.partial_blocks
            seq.offload.prefetched = DEVICE_PREFETCHED if whole else DEVICE_PARTIAL
        self._retire(s, FOLLOWED)  # (its request came: what is on device is cache now)

    # ---- the allocator's Reclaimer ------------------------------------------------------
    def reclaimable(self) -> int:
        """Blocks a purge could free now: held here only (a request that uses a block
        keeps it) and not under a load."""
        rc = self.blocks.refcount
        return sum(rc[b] == 1 for s in self.sessions.values() if s.loading is None
                   for blocks in s.held for b in blocks)

    def reclaim(self, n: int) -> int:
        """(the allocator, out of blocks) Purge prefetched layers in purge order until
        ``n`` blocks are free; how many were freed."""
        return self.purger.purge(self.sessions.values(), n, above_layer=-1)

    # ---- filling ------------------------------------------------------------------------
    def fill(self) -> None:
        """Grant free blocks to advised sessions' next layers, lowest layer first across
        sessions (§3.4), and start their loads."""
        want = [s for s in self.sessions.values() if self._wants_more(s)]
        if not want:
            return
        here = self.demand.sessions()
        want = [s for s in want if s.key not in here]  # its request came: too late
        if not want:
            return
        want.sort(key=lambda s: (-s.order.priority, s.advised_at))
        granted: dict[int, list[Grant]] = {}
        # Free memory ran out for sessions that take only free blocks: none of them gets a
        # higher layer now. Straight-to-device ones (evicting the cache) go on.
        free_ran_out = False
        reserve = self.demand.blocks_wanted_next_step() if self.cooperative else 0
        layers = range(self.kv.num_layers)
        if self.purge_order == LAYERS:
            order = [(layer, s) for layer in layers for s in want]
        else:
            order = [(layer, s) for s in want for layer in layers]
        busy_layer = -1
        for layer, s in order:
            if layer == busy_layer or len(s.held) + len(granted.get(id(s), [])) != layer or (
                    free_ran_out and not s.order.straight):
                continue
            got = self._grant(s, layer, set(granted), reserve)
            if got is None:
                if s.order.straight:
                    busy_layer = layer  # not even by eviction: the device is busy
                    continue
                free_ran_out = True
                continue
            granted.setdefault(id(s), []).append(got)
        for s in want:
            if id(s) in granted:
                self._start(s, granted[id(s)])

    def fill_pending(self) -> bool:
        """Whether a fill would start a load now: an advised session lacks layers (purged
        under pressure, say while its tool runs) and its next layer fits in free memory and
        plain cache. The engine steps for it even with nothing else to run, so the purged
        layers come back before the session's request does (issue 41); never true when no
        room is there, so an idle engine does not spin on it."""
        blocks = self.blocks
        room = (blocks.num_free_or_committable() + blocks.num_evictable
                - (self.demand.blocks_wanted_next_step() if self.cooperative else 0))
        here = self.demand.sessions()
        for s in self.sessions.values():
            if self._wants_more(s) and s.key not in here:
                layer = len(s.held)
                need = sum(blocks.cached_block((h, layer)) is None for h in s.hashes)
                if need <= room:
                    return True
        return False

    def _wants_more(self, s: Advised) -> bool:
        return (s.loading is None and not s.failed and not s.retire
                and len(s.held) < self.kv.num_layers)

    def _grant(self, s: Advised, layer: int, busy: set[int], reserve: int) -> Grant | None:
        """Blocks for ``s``'s ``layer``: the ones cached already (adopted), new ones for the
        rest from free memory beyond ``reserve`` (what running requests may need next);
        None (nothing taken) when they do not fit. ``busy``: sessions granted a layer in
        this pass (not purged for another)."""
        blocks = self.blocks
        cached = [blocks.cached_block((h, layer)) for h in s.hashes]
        adopted = [b for b in cached if b is not None]
        blocks.touch(adopted)  # first: making room must not evict or purge them
        need = len(cached) - len(adopted)

        def room() -> int:  # free blocks and plain device cache, past the reserve
            return blocks.num_free_or_committable() + blocks.num_evictable - reserve

        if need > room():
            # Purge only when that makes the room: a purge in vain would be reloaded by
            # its session next step, to be purged again.
            prio, straight = s.order.priority, s.order.straight
            above, spared = layer, busy
            if self.purge_order == SESSIONS:  # any layer of a less recently advised one
                above, spared = -1, busy | {id(o) for o in self.sessions.values()
                                            if o.advised_at >= s.advised_at}
            sessions = self.sessions.values()
            if need <= room() + self.purger.purgeable(sessions, above, prio, straight,
                                                      spared):
                self.purger.purge(sessions, need - room(), above, prio, straight, spared)
        if need > room():
            blocks.free(adopted)
            return None
        short = need - blocks.num_free_or_committable()
        if short > 0:
            blocks.evict(short)  # the least recently used plain cache (expired first)
        new = blocks.allocate_free(need) if need else []
        assert new is not None, "evicting made the room it counted"
        it = iter(new)
        return layer, [b if b is not None else next(it) for b in cached], set(new)

    def _start(self, s: Advised, grants: list[Grant]) -> None:
        if not any(new for _, _, new in grants):  # every block was on device already
            s.held.extend(blocks for _, blocks, _ in grants)
            return
        plan = s.order.plan
        if s.lease_used:
            plan = ReusePlan(plan.spans, "", 0, plan.end_block)  # (the tiers are searched)
        s.lease_used = True
        n, layers = len(s.hashes), self.kv.num_layers
        ids = [SKIP] * (n * layers)  # layer-major over the session's blocks
        for layer, blocks, new in grants:
            for i, b in enumerate(blocks):
                if b in new:
                    ids[layer * n + i] = b
        s.loading = LayerReadiness(layers)
        s.grants = grants
        if self.watch is not None:
            self.watch.started(s.hashes[0])
        self.transport.start_load(LoadJob(f"prefetch-{s.order.session.session_id}",
                                          s.order.session.tenant, plan, tuple(ids), s.loading))

    def _settle(self, s: Advised) -> None:
        """``s``'s load RPC ended: index the layers it loaded, drop the others."""
        ready, grants = s.loading, s.grants
        assert ready is not None
        s.loading, s.grants = None, []
        through = ready.loaded_through
        for layer, blocks, new in grants:
            if layer > through or s.failed:
                s.failed = True
                self.blocks.discard(b for b in blocks if b in new)
                self.blocks.free(b for b in blocks if b not in new)
                continue
            for i, b in enumerate(blocks):
                if b in new and not self.blocks.cache(b, (s.hashes[i], layer)):
                    other = self.blocks.cached_block((s.hashes[i], layer))  # computed meanwhile
                    assert other is not None
                    self.blocks.touch([other])
                    self.blocks.discard([b])
                    blocks[i] = other
            s.held.append(blocks)
            nbytes = len(new) * self.block_bytes
            s.loaded_bytes += nbytes
            self.loaded_bytes += nbytes
        if s.failed:
            log.info("prefetch of session %s stopped at layer %d: %s", s.order.session,
                     len(s.held), ready.error)
        if self.watch is not None:  # (after indexing: a request joining it finds the blocks)
            self.watch.settled(s.hashes[0])
        if s.retire:
            self._retire(s, s.retire)

    # ---- leaving the book ---------------------------------------------------------------
    def _retire(self, s: Advised, how: str) -> None:
        """``s`` leaves the book (after its load ends, if one is under way)."""
        if s.loading is not None:
            s.retire = how
            return
        if self.sessions.get(s.key) is s:
            del self.sessions[s.key]
        elif s in self._retiring:
            self._retiring.remove(s)
        if not s.lease_used:
            s.lease_used = True
            self._release_lease(s.order.plan.lease_id)
        order = [b for blocks in reversed(s.held) for b in reversed(blocks)]  # later first
        s.held = []
        if how == INVALIDATED:
            self.blocks.discard(order)
        elif how == EXPIRED:
            self.blocks.free_first(order)
        else:
            self.blocks.free(order)
        if how != FOLLOWED:
            self.wasted_bytes += s.loaded_bytes
        self.outcomes[how] = self.outcomes.get(how, 0) + 1

    def _release_lease(self, lease_id: str) -> None:
        if lease_id:
            self.transport.release(lease_id)

    # ---- accounting ---------------------------------------------------------------------
    def _all(self) -> list[Advised]:
        return [*self.sessions.values(), *self._retiring]

    @property
    def loading(self) -> bool:
        return any(s.loading is not None for s in self._all())

    def held_blocks(self) -> list[int]:
        """Block references held here (resident layers and loads in flight)."""
        out = [b for s in self._all() for blocks in s.held for b in blocks]
        out.extend(b for s in self._all() for _, blocks, _ in s.grants for b in blocks)
        return out

    def resident_layers(self, session: SessionKey) -> int:
        s = self.sessions.get(session)
        return len(s.held) if s is not None else 0

    def stats(self) -> PrefetchStats:
        """(every step publishes these: counts per layer, not per block)"""
        resident = sum(len(b) for s in self._all() for b in s.held)
        return PrefetchStats(
            sessions=len(self.sessions),
            blocks_held=resident + sum(len(b) for s in self._all() for _, b, _ in s.grants),
            blocks_resident=resident,
            loaded_bytes=self.loaded_bytes,
            wasted_bytes=self.wasted_bytes,
            purged_blocks_by_layer=list(self.purged_by_layer),
            outcomes=dict(self.outcomes),
        )
