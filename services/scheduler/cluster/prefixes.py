"""Which nodes hold which prompt prefixes: one index for both of the scheduler's uses.

A prefix is a chain of hashes (``prefix_hashes.py``): hash i names the prompt's first
i + 1 parts, so a node holding hash i is worth something only if it holds 0..i too. The
index keeps, per node, an LRU of the hashes it holds (at most ``capacity`` per node, the
least recently recorded going first, as an engine's prefix cache or a kvstore evicts),
and, the other way round, the nodes holding each hash. Two instances serve two callers:

- the ``prefix`` baseline policy (precise prefix-aware routing as llm-d does it): block
  hashes of the prompt on each node's *device*; ``matches`` counts a node's leading run,
  ``served`` records a turn, ``evicted`` forgets what a node reports dropped,
  ``capacity`` is the device's size in the index's blocks;
- a new session's locality (``balanced``, ``sticky``): leading-message hashes of the
  chat, fed by the turns that end on a node (``turn_ended``) and by the save reports its
  heartbeats carry (``saved``: the node's kvstore holds them now); ``holders`` answers
  with the nodes holding the longest known part, most recent first.

    prompt  [ p0 | p1 | p2 | p3 | p4 ]     hashes h0 → h1 → h2 → h3 → h4
    node A  {h0 h1 h2}           match(A) = 3 leading parts
    node B  {h0 h1 h2 h3}        match(B) = 4  ← prefix routes here; holders(...) = (B, A)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import count

from shared.session_key import SessionKey

Hash = str | bytes
NODES_PER_PREFIX = 4  # holders() names at most this many


class PrefixIndex:
    """Per-node LRU sets of prefix hashes. Not thread-safe: the scheduler's event loop owns
    it (the ``Dispatcher`` updates it as turns end)."""

    def __init__(self, capacity: int, sessions: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1, got {capacity}")
        self.capacity = capacity
        self.sessions_max = sessions
        self._held: dict[str, OrderedDict[Hash, int]] = {}  # node -> hash -> when recorded
        self._where: dict[Hash, set[str]] = {}  # hash -> nodes holding it
        self._tick = count()
        self._of_session: OrderedDict[SessionKey, tuple[Hash, ...]] = OrderedDict()

    def __len__(self) -> int:
        """Distinct hashes held anywhere."""
        return len(self._where)

    # ------------------------------------------------------------------ what nodes hold

    def served(self, node_id: str, hashes: Iterable[Hash]) -> None:
        """A turn with this prefix ended on ``node_id``: its hashes are there, most
        recently used; the least recently used beyond the capacity go."""
        held = self._held.setdefault(node_id, OrderedDict())
        for h in hashes:
            held[h] = next(self._tick)
            held.move_to_end(h)
            self._where.setdefault(h, set()).add(node_id)
        while len(held) > self.capacity:
            self._drop(node_id, held.popitem(last=False)[0])

    def evicted(self, node_id: str, hashes: Iterable[Hash]) -> None:
        """The node no longer holds these."""
        held = self._held.get(node_id)
        if held:
            for h in hashes:
                if held.pop(h, None) is not None:
                    self._drop(node_id, h)

    def forget_node(self, node_id: str) -> None:
        """A node that left (or restarted) holds nothing."""
        for h in self._held.pop(node_id, {}):
            self._drop(node_id, h)

    def _drop(self, node_id: str, h: Hash) -> None:
        nodes = self._where.get(h)
        if nodes is not None:
            nodes.discard(node_id)
            if not nodes:
                del self._where[h]

    def size(self, node_id: str) -> int:
        return len(self._held.get(node_id, ()))

    # ------------------------------------------------------------------ queries

    def match(self, node_id: str, hashes: Iterable[Hash]) -> int:
        """How many leading hashes the node holds (the chain makes hash i worthless
        without 0..i-1, so the count stops at the first gap)."""
        held = self._held.get(node_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def matches(self, node_ids: Iterable[str], hashes: tuple[Hash, ...]) -> dict[str, int]:
        """``match`` of every node that holds at least the first hash."""
        return {n: k for n in node_ids if (k := self.match(n, hashes)) > 0}

    def holders(self, prefix: tuple[Hash, ...]) -> tuple[str, ...]:
        """The nodes holding the longest known part of ``prefix``, the most recent
        first (at most ``NODES_PER_PREFIX``)."""
        for h in reversed(prefix):
            nodes = self._where.get(h)
            if nodes:
                ranked = sorted(nodes, key=lambda n: self._held[n][h], reverse=True)
                return tuple(ranked[:NODES_PER_PREFIX])
        return ()

    # ------------------------------------------------------------------ sessions

    def turn_ended(self, tenant: str, session_id: str, prefix: tuple[Hash, ...],
                   node_id: str) -> None:
        """A turn with this prefix ended on ``node_id``; the session's prefix is kept
        (bounded, oldest first) for its save reports."""
        if session_id and prefix:
            key = SessionKey(tenant, session_id)
            self._of_session.pop(key, None)
            self._of_session[key] = prefix
            while len(self._of_session) > self.sessions_max:
                self._of_session.popitem(last=False)
        self.served(node_id, prefix)

    def saved(self, tenant: str, session_id: str, node_id: str) -> None:
        """``node_id`` reported the session saved: its kvstore holds the session's prefix."""
        prefix = self._of_session.get(SessionKey(tenant, session_id))
        if prefix:
            self.served(node_id, prefix)
