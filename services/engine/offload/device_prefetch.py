"""Advised sessions' KV prefetched into free device blocks (Symphony §3.4, §3.6).

An advisory has the node's kvstore stage a session's KV in DRAM (kvstore/prefetch.py);
the engine then copies it into device blocks nobody uses, indexed in the prefix cache
under the same content hashes a request's prompt has (the kvstore's sequence of the
session *is* the prompt's prefix), so the request finds it like any reuse. Prefetched
blocks are a state of their own: used in the allocator, one reference held here, given up
by the engine itself when running requests need memory (cooperative memory).

    fill (every step):  for layer 0 .. L-1:                  lower layers of every
                          for each advised session lacking it:   advised session before a
                            room (or purge a higher layer,         higher layer of any
                            only if that makes it); else stop      (§3.4)
    purge order:        later layers first across sessions, then the lower priority,
                        then the least recently advised session (§3.4: "later-layer
                        caches are discarded first, followed by ... the least recently
                        used request"); to make room for a prefetch, only higher layers
                        of sessions of no higher priority (or lower-priority sessions)
    room:               free blocks and the plain device cache (least recently used
                        first), beyond what running requests and the head of the queue
                        may need next step; a straight-to-device session (the
                        ``priority`` policy) may also purge lower-priority sessions'
                        prefetched blocks at any layer
    its request came:   the request holds the blocks it uses; the session leaves the book
                        (a session with a request in the engine is not filled)
    expired (§3.6):     unfollowed within its TTL: its blocks go to the front of the
                        device cache's eviction order (the first to purge)
    invalidated:        its blocks are freed at once

A purged layer's copy stays in the kvstore's DRAM: nothing is lost and nothing moves
back; a request that arrives loads the missing upper layers layer-wise from it
(``BlockTables.find_partial_run``). Runs on the engine's worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from services.engine.api_types import PrefetchStats
from services.engine.kvcache.block_tables import BlockTables
from services.engine.offload.jobs import LoadJob
from services.engine.offload.layer_readiness import LayerReadiness
from services.engine.offload.planner import SKIP, ReusePlan
from services.engine.sequence import Sequence
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

FOLLOWED, EXPIRED, INVALIDATED, REPLACED = "followed", "expired", "invalidated", "replaced"
DEVICE_PREFETCHED, DEVICE_PARTIAL = "device_prefetched", "device_partial"
LAYERS, SESSIONS = "layers", "sessions"  # purge (and fill) orders


@dataclass(frozen=True)
class PrefetchOrder:
    """What the event loop found for an advised session: its stored block hashes and the
    kvstore spans (with a lease) covering blocks ``[0, len(hashes))``."""

    tenant: str
    session_id: str
    hashes: tuple[bytes, ...]
    plan: ReusePlan
    priority: int = 0
    ttl_s: float = 30.0
    straight: bool = False  # the priority policy: may purge lower priorities at any layer


@dataclass(eq=False)
class _Advised:
    order: PrefetchOrder
    advised_at: float
    expires_at: float
    held: list[list[int]] = field(default_factory=list)  # layers [0, k): block per hash
    loading: LayerReadiness | None = None
    # The load in flight: (layer, block per hash, the blocks it writes) per granted layer.
    grants: list[tuple[int, list[int], set[int]]] = field(default_factory=list)
    lease_used: bool = False
    failed: bool = False
    retire: str = ""  # leaves the book once its load has ended
    loaded_bytes: int = 0

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.order.tenant, self.order.session_id)

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return self.order.hashes


class DevicePrefetch:
    def __init__(self, kv: BlockTables, block_bytes: int,
                 clock: Callable[[], float] = time.monotonic, cooperative: bool = True,
                 purge_order: str = LAYERS) -> None:
        self.kv = kv
        # Ablations (Symphony §4.5): without cooperation prefetched blocks are never given
        # back to running requests nor kept out of their next step's way; ``SESSIONS``
        # fills and purges whole sessions (least recently advised first) instead of
        # lower layers of every session before higher layers of any.
        self.cooperative = cooperative
        self.purge_order = purge_order
        self.pool = kv.pool
        self.block_bytes = block_bytes
        self.clock = clock
        self.start_load: Callable[[LoadJob], None] | None = None  # set once connected
        self.release_lease: Callable[[str], None] = lambda lease_id: None
        self.sessions: dict[SessionKey, _Advised] = {}
        self.purged_by_layer = [0] * kv.num_layers
        self.loaded_bytes = 0
        self.wasted_bytes = 0
        self.outcomes: dict[str, int] = {}
        # First block hashes of sessions whose load is in flight: read by the event loop
        # (a request of that prefix waits for the load rather than load it twice).
        self.in_flight: frozenset[bytes] = frozenset()
        self._retiring: list[_Advised] = []  # replaced while loading: settled, then gone
        # Free blocks prefetch leaves alone: what running requests may need next step.
        self.reserve: Callable[[], int] = lambda: 0
        # (tenant, session) of the requests in the engine now.
        self.live_sessions: Callable[[], Collection[SessionKey]] = lambda: ()
        if cooperative:
            self.pool.reclaimer = self.reclaim
            self.pool.reclaimable = self.reclaimable

    # ---- orders from the event loop -----------------------------------------------------
    def add(self, order: PrefetchOrder) -> None:
        """Prefetch ``order``'s session (again: an advisory for a known session renews it;
        one with another sequence replaces it)."""
        now = self.clock()
        plan = order.plan
        n = min(len(order.hashes), plan.end_block) if plan.first_block == 0 else 0
        if n == 0:
            self.release_lease(plan.lease_id)
            return
        order = PrefetchOrder(order.tenant, order.session_id, order.hashes[:n], plan,
                              order.priority, order.ttl_s, order.straight)
        old = self.sessions.get(SessionKey(order.tenant, order.session_id))
        if old is not None and not old.retire and old.hashes == order.hashes:
            # Renewed: the old spans stay right (later loads search the tiers, no lease).
            self.release_lease(plan.lease_id)
            old.advised_at, old.expires_at = now, now + order.ttl_s
            old.order = PrefetchOrder(order.tenant, order.session_id, order.hashes,
                                      old.order.plan, order.priority, order.ttl_s,
                                      order.straight)
            return
        if old is not None:
            self._retire(old, REPLACED)
            if old.loading is not None:  # it leaves once its load has ended
                self._retiring.append(old)
        self.sessions[SessionKey(order.tenant, order.session_id)] = _Advised(
            order, now, now + order.ttl_s)

    def end(self, tenant: str, session_id: str, expired: bool = False) -> bool:
        """The advisory ended unfollowed: invalidated (the session's blocks are freed at
        once) or ``expired`` (they become the first to purge); whether it was known."""
        s = self.sessions.get(SessionKey(tenant, session_id))
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
        s = self.sessions.get(SessionKey(seq.tenant, seq.session_id))
        if s is None or s.retire:
            return
        if s.held and seq.block_tables[0] and seq.block_tables[0][0] == s.held[0][0]:
            whole = len(s.held) == self.kv.num_layers and not seq.offload.partial_blocks
            seq.offload.prefetched = DEVICE_PREFETCHED if whole else DEVICE_PARTIAL
        self._retire(s, FOLLOWED)  # (its request came: what is on device is cache now)

    def reclaimable(self) -> int:
        """Blocks a purge could free now: held here only (a request that uses a block
        keeps it) and not under a load."""
        rc = self.pool.refcount
        return sum(rc[b] == 1 for s in self.sessions.values() if s.loading is None
                   for blocks in s.held for b in blocks)

    def reclaim(self, n: int) -> int:
        """(the allocator, out of blocks) Purge prefetched layers in purge order until
        ``n`` blocks are free; how many were freed."""
        return self._purge(n, above_layer=-1)

    # ---- filling ------------------------------------------------------------------------
    def fill(self) -> None:
        """Grant free blocks to advised sessions' next layers, lowest layer first across
        sessions (§3.4), and start their loads."""
        if self.start_load is None:
            return
        want = [s for s in self.sessions.values() if self._wants_more(s)]
        if not want:
            return
        here = self.live_sessions()
        want = [s for s in want if s.key not in here]  # its request came: too late
        if not want:
            return
        want.sort(key=lambda s: (-s.order.priority, s.advised_at))
        granted: dict[int, list[tuple[int, list[int], set[int]]]] = {}
        # Free memory ran out for sessions that take only free blocks: none of them gets a
        # higher layer now. Straight-to-device ones (evicting the cache) go on.
        free_ran_out = False
        reserve = self.reserve() if self.cooperative else 0
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

    def _wants_more(self, s: _Advised) -> bool:
        return (s.loading is None and not s.failed and not s.retire
                and len(s.held) < self.kv.num_layers)

    def _grant(self, s: _Advised, layer: int, busy: set[int],
               reserve: int) -> tuple[int, list[int], set[int]] | None:
        """Blocks for ``s``'s ``layer``: the ones cached already (adopted), new ones for the
        rest from free memory beyond ``reserve`` (what running requests may need next);
        None (nothing taken) when they do not fit. ``busy``: sessions granted a layer in
        this pass (not purged for another)."""
        cached = [self.pool.lookup((h, layer)) for h in s.hashes]
        adopted = [b for b in cached if b is not None]
        self.pool.touch(adopted)  # first: making room must not evict or purge them
        need = len(cached) - len(adopted)

        def room() -> int:  # free blocks and plain device cache, past the reserve
            return self.pool.num_free_or_committable() + self.pool.num_evictable - reserve

        if need > room():
            # Purge only when that makes the room: a purge in vain would be reloaded by
            # its session next step, to be purged again.
            prio, straight = s.order.priority, s.order.straight
            above, spared = layer, busy
            if self.purge_order == SESSIONS:  # any layer of a less recently advised one
                above, spared = -1, busy | {id(o) for o in self.sessions.values()
                                            if o.advised_at >= s.advised_at}
            if need <= room() + self._purgeable(above, prio, straight, spared):
                self._purge(need - room(), above, prio, straight, spared)
        if need > room():
            self.pool.free(adopted)
            return None
        short = need - self.pool.num_free_or_committable()
        if short > 0:
            self.pool.evict(short)  # the least recently used plain cache (expired first)
        new = self.pool.allocate_free(need) if need else []
        assert new is not None, "evicting made the room it counted"
        it = iter(new)
        blocks = [b if b is not None else next(it) for b in cached]
        return layer, blocks, set(new)

    def _start(self, s: _Advised, grants: list[tuple[int, list[int], set[int]]]) -> None:
        if not any(new for _, _, new in grants):  # every block was on device already
            s.held.extend(blocks for _, blocks, _ in grants)
            return
        plan = s.order.plan
        if s.lease_used:
            plan = ReusePlan(plan.spans, "", 0, plan.end_block)  # (the tiers are searched)
        s.lease_used = True
        n, layers = len(s.hashes), self.kv.num_layers
        ids = [SKIP] * (n * layers)
        for layer, blocks, new in grants:
            for i, b in enumerate(blocks):
                if b in new:
                    ids[layer * n + i] = b
        s.loading = LayerReadiness(layers)
        s.grants = grants
        self.in_flight = self.in_flight | {s.hashes[0]}
        assert self.start_load is not None
        self.start_load(LoadJob(f"prefetch-{s.order.session_id}", s.order.tenant, plan,
                                tuple(ids), s.loading))

    def _settle(self, s: _Advised) -> None:
        """``s``'s load RPC ended: index the layers it loaded, drop the others."""
        ready, grants = s.loading, s.grants
        assert ready is not None
        s.loading, s.grants = None, []
        self.in_flight = frozenset(x.hashes[0] for x in self._all() if x.loading is not None)
        through = ready.loaded_through
        for layer, blocks, new in grants:
            if layer > through or s.failed:
                s.failed = True
                self.pool.discard(b for b in blocks if b in new)
                self.pool.free(b for b in blocks if b not in new)
                continue
            for i, b in enumerate(blocks):
                if b in new and not self.pool.cache(b, (s.hashes[i], layer)):
                    other = self.pool.lookup((s.hashes[i], layer))  # computed meanwhile
                    assert other is not None
                    self.pool.touch([other])
                    self.pool.discard([b])
                    blocks[i] = other
            s.held.append(blocks)
            nbytes = len(new) * self.block_bytes
            s.loaded_bytes += nbytes
            self.loaded_bytes += nbytes
        if s.failed:
            log.info("prefetch of session %s stopped at layer %d: %s", s.order.session_id,
                     len(s.held), ready.error)
        if s.retire:
            self._retire(s, s.retire)

    # ---- giving blocks up ---------------------------------------------------------------
    def _purgeable(self, above_layer: int, for_priority: int, straight: bool,
                   busy: Collection[int]) -> int:
        """Blocks ``_purge`` with these rules could free at most (an estimate from above:
        a top layer a request uses stops its session's purge there)."""
        rc, n = self.pool.refcount, 0
        for s in self.sessions.values():
            if id(s) in busy or s.loading is not None or s.order.priority > for_priority:
                continue
            lowest = 0 if straight and s.order.priority < for_priority else above_layer + 1
            n += sum(rc[b] == 1 for blocks in s.held[lowest:] for b in blocks)
        return n

    def _purge(self, n: int, above_layer: int, for_priority: int | None = None,
               straight: bool = False, busy: Collection[int] = ()) -> int:
        """Drop prefetched top layers in purge order until ``n`` blocks are free. To make
        room for a prefetch of ``for_priority``: only layers above ``above_layer`` of
        sessions of no higher priority (lower layers of every session first), and, when
        ``straight`` (the priority policy), any layer of lower-priority sessions; never of
        a session in ``busy`` (granted a higher layer in the same pass)."""
        freed = 0

        def may_go(s: _Advised) -> bool:
            if id(s) in busy:
                return False
            if for_priority is None:
                return True
            p = s.order.priority
            if straight and p < for_priority:
                return True
            return p <= for_priority and len(s.held) - 1 > above_layer

        rc = self.pool.refcount

        def frees_some(s: _Advised) -> bool:  # (a top layer a request uses frees nothing)
            return any(rc[b] == 1 for b in s.held[-1])

        while freed < n:
            tops = [s for s in self.sessions.values() if s.held and s.loading is None
                    and may_go(s) and frees_some(s)]
            if not tops:
                break
            if self.purge_order == LAYERS:
                s = min(tops, key=lambda s: (-(len(s.held) - 1), s.order.priority,
                                             s.advised_at))
            else:  # whole sessions, the least recently advised first
                s = min(tops, key=lambda s: (s.order.priority, s.advised_at))
            layer = len(s.held) - 1
            blocks = s.held.pop()
            self.purged_by_layer[layer] += len(blocks)
            freed += self.pool.discard(blocks)
        return freed

    def _retire(self, s: _Advised, how: str) -> None:
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
            self.release_lease(s.order.plan.lease_id)
        order = [b for blocks in reversed(s.held) for b in reversed(blocks)]  # later first
        s.held = []
        if how == INVALIDATED:
            self.pool.discard(order)
        elif how == EXPIRED:
            self.pool.free_first(order)
        else:
            self.pool.free(order)
        if how != FOLLOWED:
            self.wasted_bytes += s.loaded_bytes
        self.outcomes[how] = self.outcomes.get(how, 0) + 1

    # ---- accounting ---------------------------------------------------------------------
    def _all(self) -> list[_Advised]:
        return [*self.sessions.values(), *self._retiring]

    @property
    def loading(self) -> bool:
        return any(s.loading is not None for s in self._all())

    def held_blocks(self) -> list[int]:
        """Block references held here (resident layers and loads in flight)."""
        out = [b for s in self._all() for blocks in s.held for b in blocks]
        out.extend(b for s in self._all() for _, blocks, _ in s.grants for b in blocks)
        return out

    def resident_layers(self, tenant: str, session_id: str) -> int:
        s = self.sessions.get(SessionKey(tenant, session_id))
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
