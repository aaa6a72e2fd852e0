"""One device-memory budget per node, shared by the node's engines (Prism §5.1, kvcached).

Every engine of a node maps the same small ledger file and records in it, before the fact,
the device bytes it commits: KV pages as its pool grows, its model's weights when it
activates one. A commit the ledger cannot grant fails like an exhausted pool (the request
waits or is preempted), so the engines together never hold more than the budget, whichever
of them needs the memory now. The nodemgr, the node's memory broker, reads the ledger
(bytes per engine, bytes free) to reclaim pages from idle engines for busy ones and to
evict idle models when an activation needs room.

An engine may also hold a KV *reserve* (Prism §6.3: "reserving a memory buffer per
engine"): while its KV is below its reserve, the others cannot take the difference. A
model that turns hot then starts its first requests at once, instead of waiting for the
broker to take pages back from the model that was hot before.

    file (64-byte records):  header: magic, budget, bytes used, bytes lent | slot 0 | ...
    slot:  pid, kv bytes, weight bytes, label (32 bytes of the model's name), kv reserve

*Lent* bytes (MIRAGE §5.2 across the node): weight bytes an engine handed to the node's
KV (``lend``: its weights row drops by them, the header's lent word rises); any engine's
KV pool may then grow past its own budget by that much. ``unlend`` is the reversion.

Updates hold an exclusive ``flock`` on the file (a few microseconds); a slot of a process
that no longer exists is taken over, its bytes forgotten, so a crashed engine leaks nothing.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x4F56_4C45_4447_0001  # "OVLEDG" v1
RECORD = 64
SLOTS = 32
_HEADER = struct.Struct("<QQq")  # magic, budget, bytes used by all slots
_USED = struct.Struct("<q")
_USED_AT = 16
_LENT_AT = 24  # (the header's fourth word: zero in a ledger written before it existed)
_SLOT = struct.Struct("<qQQ32s")  # pid, kv bytes, weight bytes, label
_RESERVE = struct.Struct("<Q")  # the slot's last word: its KV reserve
_RESERVE_AT = _SLOT.size
SIZE = RECORD * (1 + SLOTS)


class LedgerError(RuntimeError):
    """The ledger file is missing, not a ledger, or full."""


@dataclass(frozen=True)
class Holder:
    pid: int
    label: str
    kv_bytes: int
    weight_bytes: int
    reserve_bytes: int = 0


def create_ledger(path: str | Path, budget_bytes: int) -> Path:
    """Write an empty ledger for a node budget of ``budget_bytes`` (replacing any)."""
    p = Path(path)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    data = bytearray(SIZE)
    _HEADER.pack_into(data, 0, MAGIC, budget_bytes, 0)
    tmp.write_bytes(bytes(data))
    tmp.replace(p)
    return p


class DeviceLedger:
    """This process's view of the node's ledger; ``join`` claims a slot to record in."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._slot: int | None = None
        self._lent = 0  # bytes this process lent to the node's KV
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise LedgerError(f"device ledger {self.path}: {e.strerror}") from None
        try:
            self._map = mmap.mmap(self._fd, SIZE)
        except (OSError, ValueError) as e:
            os.close(self._fd)
            raise LedgerError(f"device ledger {self.path}: cannot map: {e}") from None
        magic, budget, _ = _HEADER.unpack_from(self._map, 0)
        self.budget_bytes = int(budget)
        if magic != MAGIC:
            self.close()
            raise LedgerError(f"{self.path} is not a device ledger")

    # ---- reading (no lock: each field is one aligned 8-byte word) ------------------------
    def holders(self) -> list[Holder]:
        out = []
        for i in range(SLOTS):
            pid, kv, weights, label = _SLOT.unpack_from(self._map, RECORD * (1 + i))
            if pid > 0:
                out.append(Holder(pid, label.rstrip(b"\0").decode(errors="replace"), kv, weights,
                                  self._reserve_of(i)))
        return out

    def used_bytes(self) -> int:
        """One aligned word (engines read it on every allocation decision)."""
        return int(_USED.unpack_from(self._map, _USED_AT)[0])

    def lent_bytes(self) -> int:
        """Weight bytes the node's engines lend to its KV now (``lend``)."""
        return int(_USED.unpack_from(self._map, _LENT_AT)[0])

    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes())

    def available_bytes(self, weights: bool = False) -> int:
        """What this process could take now: the free bytes less what the others' reserves
        hold back, or, for KV, what is free of its own unfilled reserve if that is more
        (reserves that add up to more than the budget are filled first come, first
        served, and never block each other)."""
        free = self.free_bytes()
        room = free - self._held_back()
        return max(0, room) if weights else max(0, room, min(free, self._unfilled_own()))

    # ---- this process's slot ------------------------------------------------------------
    def join(self, label: str = "") -> None:
        """Claim a slot (one of a process that is gone, if no slot is empty). Several
        engines in one process each join with their own ``DeviceLedger``."""
        with self._locked():
            for i in range(SLOTS):
                pid = struct.unpack_from("<q", self._map, RECORD * (1 + i))[0]
                if pid <= 0 or not _alive(pid):
                    _, kv, weights, _ = _SLOT.unpack_from(self._map, RECORD * (1 + i))
                    self._add_used(-(kv + weights))  # (what a dead process held is free)
                    _SLOT.pack_into(self._map, RECORD * (1 + i), os.getpid(), 0, 0,
                                    label.encode()[:32])
                    _RESERVE.pack_into(self._map, RECORD * (1 + i) + _RESERVE_AT, 0)
                    self._slot = i
                    return
        raise LedgerError(f"device ledger {self.path}: all {SLOTS} slots are taken")

    def label(self, label: str) -> None:
        pid, kv, weights, _ = self._mine()
        with self._locked():
            _SLOT.pack_into(self._map, self._offset(), pid, kv, weights, label.encode()[:32])

    def reserve(self, nbytes: int) -> None:
        """Hold back up to ``nbytes`` of KV for this process: while its KV is below that,
        the others cannot take the difference (0: no reserve). A claim on what is free or
        freed later, not a grant: the others keep what they hold."""
        with self._locked():
            _RESERVE.pack_into(self._map, self._offset() + _RESERVE_AT, max(0, nbytes))

    def take(self, nbytes: int, weights: bool = False) -> bool:
        """Record ``nbytes`` more held by this process if it has them available
        (``available_bytes``); whether."""
        with self._locked():
            if nbytes > self.available_bytes(weights):
                return False
            self._add(nbytes, weights)
            return True

    def lend(self, nbytes: int) -> bool:
        """Hand ``nbytes`` of this process's weights to the node's KV; False, nothing
        changed, if it does not hold that many weight bytes."""
        with self._locked():
            if self._mine()[2] < nbytes:
                return False
            self._add(-nbytes, True)
            self._add_lent(nbytes)
            self._lent += nbytes
            return True

    def unlend(self, nbytes: int) -> bool:
        """Reversion of ``lend``: the weights take ``nbytes`` back if they are available
        (False, nothing changed, while KV holds them)."""
        with self._locked():
            if nbytes > self.available_bytes(weights=True):
                return False
            self._add(nbytes, True)
            self._add_lent(-nbytes)
            self._lent -= nbytes
            return True

    def give(self, nbytes: int, weights: bool = False) -> None:
        with self._locked():
            self._add(-nbytes, weights)

    def mine(self) -> Holder:
        pid, kv, weights, label = self._mine()
        return Holder(pid, label.rstrip(b"\0").decode(errors="replace"), kv, weights)

    def leave(self) -> None:
        """Forget everything this process holds and free its slot."""
        if self._slot is not None:
            with self._locked():
                _, kv, weights, _ = self._mine()
                self._add_used(-(kv + weights))
                # (what it lent ends with it; a crashed lender's lent word stays, which only
                # lets pools reach further into a budget the ledger still bounds)
                self._add_lent(-self._lent)
                self._lent = 0
                _SLOT.pack_into(self._map, self._offset(), 0, 0, 0, b"")
                _RESERVE.pack_into(self._map, self._offset() + _RESERVE_AT, 0)
            self._slot = None

    def close(self) -> None:
        self.leave()
        self._map.close()
        os.close(self._fd)

    # ---- internals ----------------------------------------------------------------------
    def _offset(self) -> int:
        if self._slot is None:
            raise LedgerError("join the ledger before recording in it")
        return RECORD * (1 + self._slot)

    def _reserve_of(self, slot: int) -> int:
        return int(_RESERVE.unpack_from(self._map, RECORD * (1 + slot) + _RESERVE_AT)[0])

    def _held_back(self) -> int:
        """The others' reserves not yet filled by their KV, of live processes only (one
        signal-0 probe per reserve: a dead engine's reserve holds nothing back)."""
        total = 0
        for i in range(SLOTS):
            if i == self._slot:
                continue
            pid, kv, _, _ = _SLOT.unpack_from(self._map, RECORD * (1 + i))
            unfilled = self._reserve_of(i) - kv if pid > 0 else 0
            if unfilled > 0 and _alive(pid):
                total += unfilled
        return total

    def _unfilled_own(self) -> int:
        if self._slot is None:
            return 0
        return max(0, self._reserve_of(self._slot) - self._mine()[1])

    def _mine(self) -> tuple[int, int, int, bytes]:
        pid, kv, weights, label = _SLOT.unpack_from(self._map, self._offset())
        return pid, kv, weights, label

    def _add(self, nbytes: int, weights: bool) -> None:
        pid, kv, w, label = self._mine()
        before = kv + w
        if weights:
            w = max(0, w + nbytes)
        else:
            kv = max(0, kv + nbytes)
        _SLOT.pack_into(self._map, self._offset(), pid, kv, w, label)
        self._add_used(kv + w - before)

    def _add_lent(self, delta: int) -> None:
        lent = _USED.unpack_from(self._map, _LENT_AT)[0]
        _USED.pack_into(self._map, _LENT_AT, max(0, lent + delta))

    def _add_used(self, delta: int) -> None:
        used = _USED.unpack_from(self._map, _USED_AT)[0]
        _USED.pack_into(self._map, _USED_AT, max(0, used + delta))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
