"""The Reuse Store's region list (Tangram §3.2): the arena as regions chained in physical
order, each free or holding one tensor.

    offset 0                                                        capacity
    | t1 | free | t7 | t3 | free ............ | t2 | free |
      each region: (offset, size, key)   key None = free

Invariant (``check_integrity``): the regions tile [0, capacity) in order, no two free
regions are adjacent, every key appears once. Sizes are multiples of ``ALIGN`` so that
every tensor starts on an aligned address (vector loads; torch views of any dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the region alignment (a zero-byte tensor takes one unit)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


@dataclass
class Region:
    offset: int
    size: int
    key: str | None = None  # the tensor's fingerprint; None: free

    @property
    def free(self) -> bool:
        return self.key is None

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Move:
    """A tensor moved by compaction: ``size`` bytes from ``src`` to ``dst`` (dst < src,
    so moves applied in order never overwrite a source still to be moved)."""

    key: str
    src: int
    dst: int
    size: int


class RegionList:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"arena capacity must be a positive multiple of {ALIGN}")
        self.capacity = capacity
        self.regions: list[Region] = [Region(0, capacity)]
        self._where: dict[str, Region] = {}

    # ---- reading ------------------------------------------------------------------------
    def find(self, key: str) -> Region | None:
        return self._where.get(key)

    def free_bytes(self) -> int:
        return sum(r.size for r in self.regions if r.free)

    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes()

    def keys(self) -> list[str]:
        return list(self._where)

    # ---- changing -----------------------------------------------------------------------
    def place(self, index: int, key: str, size: int) -> Region:
        """Put ``key`` (``size`` aligned bytes) at the start of the free region at
        ``index``; the rest of it stays free."""
        r = self.regions[index]
        if not r.free or r.size < size or size % ALIGN or key in self._where:
            raise ValueError(f"cannot place {key} ({size} B) in region {r}")
        new = Region(r.offset, size, key)
        rest = r.size - size
        self.regions[index:index + 1] = [new] + ([Region(new.end, rest)] if rest else [])
        self._where[key] = new
        return new

    def release(self, key: str) -> Region:
        """Free ``key``'s region (merged with free neighbours); the freed range."""
        r = self._where.pop(key)
        freed = Region(r.offset, r.size)
        i = self.regions.index(r)
        self.regions[i] = Region(r.offset, r.size)
        self._coalesce(i)
        return freed

    def compact(self, start: int, stop: int, movable: set[str]) -> list[Move]:
        """Slide the movable tensors of regions[start:stop] towards the range's start, in
        order; unmovable ones stay, so the range's free space gathers before each of them
        and at its end. The moves, in the order they must be applied."""
        moves: list[Move] = []
        out: list[Region] = []
        if start >= stop:
            return moves
        cursor = self.regions[start].offset
        end = self.regions[stop - 1].end  # (before the loop moves that region)
        for r in self.regions[start:stop]:
            if r.free:
                continue
            if r.key not in movable:
                if r.offset > cursor:
                    out.append(Region(cursor, r.offset - cursor))
                out.append(r)
                cursor = r.end
                continue
            if r.offset != cursor:
                assert r.key is not None
                moves.append(Move(r.key, r.offset, cursor, r.size))
                r.offset = cursor
            out.append(r)
            cursor = r.end
        if end > cursor:
            out.append(Region(cursor, end - cursor))
        self.regions[start:stop] = out
        i = start
        while i < len(self.regions):  # (free neighbours at the range's edges)
            i = self._coalesce(i) + 1
        return moves

    def _coalesce(self, i: int) -> int:
        """Merge the free region at ``i`` with free neighbours; its new index."""
        if not self.regions[i].free:
            return i
        if i + 1 < len(self.regions) and self.regions[i + 1].free:
            nxt = self.regions.pop(i + 1)
            self.regions[i] = Region(self.regions[i].offset, self.regions[i].size + nxt.size)
        if i > 0 and self.regions[i - 1].free:
            cur = self.regions.pop(i)
            prev = self.regions[i - 1]
            self.regions[i - 1] = Region(prev.offset, prev.size + cur.size)
            i -= 1
        return i

    def check_integrity(self) -> None:
        at = 0
        seen: set[str] = set()
        for a, r in enumerate(self.regions):
            assert r.offset == at and r.size > 0 and r.size % ALIGN == 0, (a, r)
            if r.free:
                assert a == 0 or not self.regions[a - 1].free, ("adjacent free", a)
            else:
                assert r.key not in seen and self._where.get(r.key) is r, r  # type: ignore[arg-type]
                seen.add(r.key)  # type: ignore[arg-type]
            at = r.end
        assert at == self.capacity and seen == set(self._where)
