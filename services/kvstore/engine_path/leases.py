"""Prefix leases: what a LookupPrefix found stays loadable until it is loaded or released.

Eviction must never race a hit (the class of bug in vLLM #39702 and LMCache #1835), so a
lease holds, per chunk key and layer:

- a DRAM hit: the blob object itself. DRAM may evict the key meanwhile (its budget stays
  honest), but the bytes live on in the lease until it ends.
- an SSD hit: a pin on the key, so the SSD tier's eviction and sweeps skip it.
- an S3 hit: nothing (the lowest tier keeps everything until its TTL).
- a peer's chunks (``fetch``): the pull under way, with the peer's own lease on them;
  ending this lease stops the pull and ends the peer's.

A lease ends on ``release`` (LoadIntoPool's end or ReleaseLease) or ``lease_s`` after it
was granted, whichever comes first; ending it twice is harmless. A load that takes the
lease (``hold``) restarts its clock with ``HELD_FACTOR`` times the time: a slow load must
not see its chunks unpinned, and so evictable, halfway through (the load releases it when
it ends), yet a load stuck for good (a client that stopped reading but kept its
connection) does not pin them forever.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from services.kvstore.peers.fetch import PeerFetch
from services.kvstore.tiers.base import Blob, Tier

log = logging.getLogger(__name__)

HELD_FACTOR = 10  # a lease taken by a load expires after this many times lease_s


@dataclass
class Lease:
    lease_id: str
    blobs: dict[str, Blob] = field(default_factory=dict)  # chunk key -> held DRAM blob
    pins: list[tuple[Tier, str]] = field(default_factory=list)  # (tier, chunk key) pinned
    # chunk key -> the block hashes the lookup matched it against (the load re-checks them)
    expected: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    held: bool = False  # a load is using it (and releases it when it ends)
    fetch: PeerFetch | None = None  # chunks on their way from a peer (their keys: fetch.keys)


class LeaseTable:
    """Live leases by id. ``unpin(tier, key)`` undoes the pins when a lease ends."""

    def __init__(self, lease_s: float, unpin: Callable[[Tier, str], None]) -> None:
        self.lease_s = lease_s
        self._unpin = unpin
        self._leases: dict[str, Lease] = {}
        self.on_change: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, lease: Lease) -> str:
        """Register ``lease`` (its id is assigned here) and start its expiry timer."""
        lease.lease_id = f"lease-{uuid.uuid4().hex[:16]}"
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(self.lease_s, self._expire, lease.lease_id)
        self._leases[lease.lease_id] = lease
        self._changed()
        return lease.lease_id

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def hold(self, lease_id: str) -> Lease | None:
        """The live lease ``lease_id`` for a load that will ``release`` it when it ends
        (its expiry pushed out to ``HELD_FACTOR`` x ``lease_s`` from now)."""
        lease = self._leases.get(lease_id)
        if lease is not None and not lease.held:
            if lease.timer is not None:
                lease.timer.cancel()
            lease.timer = asyncio.get_running_loop().call_later(
                self.lease_s * HELD_FACTOR, self._expire, lease_id)
            lease.held = True
        return lease

    def _expire(self, lease_id: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            log.info("lease %s expired after %.1fs%s", lease_id,
                     self.lease_s * (HELD_FACTOR if lease.held else 1),
                     " (a load held it that long)" if lease.held else "")
            self.release(lease_id)

    def release(self, lease_id: str) -> bool:
        """End a lease: drop held blobs, unpin keys. False if it was not live."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        if lease.timer is not None:
            lease.timer.cancel()
        for tier, key in lease.pins:
            self._unpin(tier, key)
        lease.pins.clear()
        lease.blobs.clear()
        if lease.fetch is not None:
            lease.fetch.close()
        self._changed()
        return True

    @staticmethod
    def abandon(lease: Lease, unpin: Callable[[Tier, str], None]) -> None:
        """Undo the pins of a lease that was never granted (a lookup that failed midway)."""
        for tier, key in lease.pins:
            unpin(tier, key)
        lease.pins.clear()
        if lease.fetch is not None:
            lease.fetch.close()

    def close(self) -> None:
        for lease_id in list(self._leases):
            self.release(lease_id)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(len(self._leases))

    def check_integrity(self) -> None:
        for lid, lease in self._leases.items():
            assert lease.lease_id == lid, "lease stored under another id"
            assert lease.timer is not None, "live lease without an expiry timer"
