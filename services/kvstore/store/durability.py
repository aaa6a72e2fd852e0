"""What the store vouches for as durable in the lowest tier, without asking it.

Manifests are written on the lowest tier and may only name chunks that are there
(Symphony §3.4: the slowest tier holds the complete copy). Asking the lowest tier (a HEAD
on S3) for every chunk of every manifest is slow, so the ledger remembers chunks this
process saw acknowledged there, and forgets them when it is told they were lost.

The ledger is told about every write and every loss; it holds no reference to the store,
only to the lowest tier, which it asks when it does not know:

    write-behind submitted ──► begin_write(key, fut) ── ack ──► vouched (with its time)
    put over / delete / evict / expire / corrupt ──────────────► lost(tier_key): unsaved
    a write that was dropped (queue full, refused) ────────────► unsaved: written again

A write vouches only if it is still the chunk's latest when it ends (a generation per
write): a delete or a newer put in the meantime voids it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections import OrderedDict

from services.kvstore.errors import TierUnavailable, WriteDropped
from services.kvstore.store.keys import CHUNK_PREFIX, chunk_of, chunk_tier_key
from services.kvstore.tiers.base import Tier

DURABLE_MEMORY = 100_000  # keys remembered as durable, to spare HEAD calls on manifests


class DurabilityLedger:
    def __init__(self, lowest: Tier, ttl_s: float, memory: int = DURABLE_MEMORY) -> None:
        self.lowest = lowest
        self.ttl_s = ttl_s
        self.memory = memory
        self._durable: OrderedDict[str, float] = OrderedDict()  # key -> when written
        self._write_gen: dict[str, int] = {}
        self._gens = itertools.count()
        # Chunks whose durable write was dropped (queue full, refused): a save must write
        # them again rather than skip them as already stored.
        self._unsaved: OrderedDict[str, None] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[None]] = {}
        # Tier keys the sweep is deciding on in the lowest tier: not durable for a manifest
        # meanwhile, since its delete may land after a manifest checked the chunk.
        self.sweeping: set[str] = set()

    # ---------------------------------------------------------------- told by the store

    def landed_in_dram(self, key: str, dram_only: bool) -> None:
        """A put of chunk ``key`` reached DRAM (``dram_only``: there is no tier below, so
        DRAM's own index answers for it and nothing need be remembered)."""
        if self._unsaved:
            self._unsaved.pop(key, None)
        if dram_only:
            self._durable.pop(key, None)

    def begin_write(self, key: str, fut: asyncio.Future[None]) -> None:
        """A write of chunk ``key`` down to the lowest tier was queued; ``fut`` is its ack."""
        self._durable.pop(key, None)
        self._unsaved.pop(key, None)
        gen = self._write_gen[key] = next(self._gens)
        self._inflight[key] = fut
        fut.add_done_callback(functools.partial(self._written, key, gen))

    def _written(self, key: str, gen: int, fut: asyncio.Future[None]) -> None:
        """A chunk's write-behind ended: vouch for it only if nothing replaced or deleted
        the chunk meanwhile; a dropped write leaves it to be written again."""
        if self._inflight.get(key) is fut:
            del self._inflight[key]
        if self._write_gen.get(key) != gen:
            return
        del self._write_gen[key]
        if fut.cancelled() or fut.exception() is not None or (
                self.sweeping and CHUNK_PREFIX + key in self.sweeping):
            # (a sweep's delete of the chunk may land after this write: never vouch then)
            self.mark_unsaved(key)
        else:
            self.remember(key)

    def lost(self, tier_key: str) -> None:
        """The lowest tier lost ``tier_key`` (deleted, expired, evicted, corrupt): stop
        vouching for it, also when a write of it still in flight completes."""
        key = chunk_of(tier_key)
        if key is not None:
            self._durable.pop(key, None)
            self._write_gen.pop(key, None)
            self.mark_unsaved(key)  # a later save writes it again even if held locally

    def mark_unsaved(self, key: str) -> None:
        self._unsaved[key] = None
        if len(self._unsaved) > self.memory:
            self._unsaved.popitem(last=False)

    def remember(self, key: str, written_at: float | None = None) -> None:
        durable = self._durable
        durable[key] = time.time() if written_at is None else written_at
        durable.move_to_end(key)
        if len(durable) > self.memory:
            durable.popitem(last=False)

    # ---------------------------------------------------------------- asked by callers

    def vouches(self, key: str) -> bool | None:
        """True: known stored (in flight or acknowledged); False: known to need writing
        again; None: the ledger does not know (ask the tiers)."""
        if key in self._unsaved:
            return False
        if key in self._inflight or key in self._durable:
            return True
        return None

    def in_flight(self, key: str) -> asyncio.Future[None] | None:
        return self._inflight.get(key)

    def acknowledged(self, key: str) -> bool:
        return key in self._durable

    async def is_durable(self, key: str) -> bool:
        """Whether ``key`` is in the lowest tier, waiting for an in-flight write first."""
        fut = self._inflight.get(key)
        if fut is not None:
            try:
                await asyncio.shield(fut)
            except WriteDropped:
                return False
        # An ack vouches only if nothing deleted the chunk while it was written (its
        # ``_written`` callback, which ran before ours, decided that).
        return bool(await self.durable_for_a_ttl(key))

    async def durable_for_a_ttl(self, key: str) -> bool | None:
        """Whether chunk ``key`` is in the lowest tier with at least half its TTL to go.

        A manifest is rewritten every turn but names chunks of every earlier turn; the
        lowest tier expires each chunk by its own age. So a chunk older than half the
        TTL is refreshed (its clock restarted) before a manifest may name it: a session in
        use never has its early chunks expire under a manifest (Symphony §3.4). What this
        process wrote recently is trusted without asking. None: unknown (the lowest tier
        did not answer)."""
        tkey = chunk_tier_key(key)
        if tkey in self.sweeping:
            return False
        now = time.time()
        at = self._durable.get(key)
        if at is not None and now - at < self.ttl_s / 2:
            return True
        try:
            at = await self.lowest.written_at(tkey)
            if at is not None and now - at >= self.ttl_s / 2:
                at = now if await self.lowest.refresh(tkey) else None
        except TierUnavailable:
            return None
        if at is None:
            self.lost(tkey)
            return False
        if tkey in self.sweeping:  # the sweep started on it while we asked: it may delete it
            return False
        self.remember(key, at)
        return True

    def check_integrity(self) -> None:
        assert all(not f.done() for f in self._inflight.values()), "finished write still in flight"
