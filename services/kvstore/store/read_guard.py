"""Reads below DRAM that raced a put or a delete of their key must not promote.

A read of an SSD or S3 copy takes time; if the key is put (a newer version) or deleted
meanwhile, promoting what the read found would serve an older copy over the newer put, or
bring a deleted chunk back. The store marks every read below DRAM here and tells the guard
about every put and delete; a read may promote only what nobody changed while it ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ReadGuard:
    def __init__(self) -> None:
        self._reading: dict[str, int] = {}  # tier key -> reads under way
        self._changed: set[str] = set()  # of those, put or deleted meanwhile

    def changed(self, tier_key: str) -> None:
        """``tier_key`` was put or deleted: reads of it under way must not promote."""
        if self._reading and tier_key in self._reading:
            self._changed.add(tier_key)

    def may_promote(self, tier_key: str) -> bool:
        return tier_key not in self._changed

    @contextmanager
    def reading(self, tier_keys: list[str]) -> Iterator[None]:
        """Reads of ``tier_keys`` run inside this block."""
        for tk in tier_keys:
            self._reading[tk] = self._reading.get(tk, 0) + 1
        try:
            yield
        finally:
            for tk in tier_keys:
                n = self._reading.pop(tk) - 1
                if n:
                    self._reading[tk] = n
                else:
                    self._changed.discard(tk)
