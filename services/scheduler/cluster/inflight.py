"""The generations running on each node, and when each is expected to end.

An advisory announces a request that arrives later, so it must be placed by the load
expected *then* (Symphony §3.3: the scheduler places the advised request ahead of time).
Counting the load of the moment is wrong for an agent: its successor is advised while the
predecessor still runs, often on the node that holds the successor's KV, and that running
predecessor, which will have ended by the time the successor arrives, would push the
successor to another node and make it recompute its shared context.

Per node this keeps each generation the scheduler routed there (its ``max_tokens`` and
the tokens produced so far) and the node's measured time per output token (an
exponentially weighted mean over the gaps between a stream's chunks). A generation is
expected to end after its remaining tokens times that TPOT::

    started ──first token── produced ─────────────── max_tokens
                            │◄── (max_tokens − produced) × TPOT ──►│ expected end

``finishing(within_s)`` counts, per node, those expected to end within ``within_s``.
An estimate from ``max_tokens`` is an upper bound (a turn usually stops earlier), so a
request counted as still running may in fact be done: the error is on the safe side.
Event-loop only; the clock is injectable.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.scheduler.cluster.node import Node

Clock = Callable[[], float]

# A request without a max_tokens runs up to the context: treat it as never ending soon.
UNBOUNDED = 1 << 30


@dataclass
class _Running:
    node_id: str
    max_tokens: int
    produced: int = 0
    last_at: float = 0.0  # clock time of the last chunk with tokens (0: none yet)
    first_at: float = 0.0  # clock time of its first token (0: none yet)


class InFlight:
    """Event-loop only."""

    def __init__(self, default_tpot_s: float = 0.05, weight: float = 0.2,
                 clock: Clock = time.monotonic) -> None:
        self.default_tpot_s = default_tpot_s  # a node's TPOT before it was measured
        self.weight = weight  # of a new gap in the mean
        self.clock = clock
        self._running: dict[int, _Running] = {}
        self._tpot: dict[str, float] = {}
        self._tickets = itertools.count(1)
        self._ended: dict[str, deque[float]] = {}  # per node, the latest ends (clock times)
        # Per node, the latest ends of generations that produced tokens: (clock time, time
        # from first token to end), for the node's measured capacity (``served``).
        self._served: dict[str, deque[tuple[float, float]]] = {}

    def __len__(self) -> int:
        return len(self._running)

    def begin(self, node_id: str, max_tokens: int) -> int:
        """A generation started on ``node_id``; its ticket for ``progress`` and ``end``."""
        ticket = next(self._tickets)
        self._running[ticket] = _Running(node_id, max_tokens if max_tokens > 0 else UNBOUNDED)
        return ticket

    def progress(self, ticket: int, tokens: int) -> None:
        """``tokens`` more were produced. The gap since the previous chunk with tokens is a
        sample of the node's TPOT (the first chunk's wait is prefill, not decode)."""
        run = self._running.get(ticket)
        if run is None or tokens <= 0:
            return
        now = self.clock()
        if run.last_at > 0.0:
            gap = (now - run.last_at) / tokens
            old = self._tpot.get(run.node_id)
            self._tpot[run.node_id] = gap if old is None else old + self.weight * (gap - old)
        else:
            run.first_at = now
        run.produced += tokens
        run.last_at = now

    def end(self, ticket: int) -> None:
        run = self._running.pop(ticket, None)
        if run is not None:
            now = self.clock()
            self._ended.setdefault(run.node_id, deque(maxlen=256)).append(now)
            if run.first_at:
                self._served.setdefault(run.node_id, deque(maxlen=4096)).append(
                    (now, now - run.first_at))

    def served(self, node_id: str, horizon_s: float) -> tuple[float, float]:
        """The generations of ``node_id`` that ended within the last ``horizon_s`` after
        producing tokens: how many a second, and their mean time from first token to end
        ((0.0, 0.0): none)."""
        since = self.clock() - horizon_s
        count, held = 0, 0.0
        for t, h in reversed(self._served.get(node_id, ())):
            if t <= since:
                break
            count, held = count + 1, held + h
        return (count / horizon_s, held / count) if count else (0.0, 0.0)

    def ended_since(self, node_id: str, since: float) -> int:
        """Generations of ``node_id`` that ended after clock time ``since``: a heartbeat
        sent before then still counts them as running."""
        return sum(1 for t in self._ended.get(node_id, ()) if t > since)

    def tpot(self, node_id: str) -> float:
        return self._tpot.get(node_id, self.default_tpot_s)

    def remaining_s(self, ticket: int) -> float:
        """Seconds until the generation is expected to end (0: unknown ticket)."""
        run = self._running.get(ticket)
        if run is None:
            return 0.0
        return max(0, run.max_tokens - run.produced) * self.tpot(run.node_id)

    def finishing(self, within_s: float) -> dict[str, int]:
        """Per node, the generations expected to have ended ``within_s`` from now."""
        out: dict[str, int] = {}
        if within_s <= 0:
            return out
        for ticket, run in self._running.items():
            if self.remaining_s(ticket) <= within_s:
                out[run.node_id] = out.get(run.node_id, 0) + 1
        return out

    def gone(self, nodes: Sequence[Node], within_s: float = 0.0) -> dict[str, int]:
        """Per node, the load counted now (``Node.expected``) that will be gone
        ``within_s`` from now: the generations expected to end by then (counted in
        ``routed`` and, once a beat reported them, in the engine's ``running``), and
        those that ended since the node's last heartbeat (still in its ``running``)."""
        finishing = self.finishing(within_s)
        out = {}
        for n in nodes:
            f = finishing.get(n.node_id, 0)
            stale = self.ended_since(n.node_id, n.last_beat)
            if f or stale:
                out[n.node_id] = f + min(f + stale, n.load.running)
        return out
