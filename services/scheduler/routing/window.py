"""Admission at the scheduler: each node's window of generations in flight, sized from its
measured capacity, so that load the cluster cannot start in time is refused (429) at the
door instead of queued in the hops.

Why here and not only in the engines: at ten times a cluster's capacity the engines held
their own queue to the limit (``engine/wait_forecast.py``), yet the admitted requests'
first token came nine times the limit late (bench/README.md, "Admission that keeps its
promise"). The wait had moved before and after the engine: into the scheduler, the node
managers and the way back, which every request the engines then refused had crossed too.
A window per node stops that traffic where it starts.

The window is Little's law, L = λ·W. A node whose generations complete at λ a second and
hold their seat for Ŝ from first token to end has λ·Ŝ of them running and, if each waits
w for its first token, λ·w more waiting; with more in flight they wait longer. So::

    window = max(min_window, ceil(λ × (Ŝ + scale × wait_s)))

Ŝ is measured over the node's completions of the last ``horizon_s``
(``InFlight.served``), and λ is the node's capacity: the highest completion rate of those
horizons, forgotten with a time constant of ``MEMORY`` horizons. Not the rate of the
moment: a full window bounds the completions, and sized from them the window would follow
any delay outside the node (a slow hop, a starved core) down to its minimum, and the
throughput with it. While first tokens come in time, a window is never smaller than the
node's seats (the sequences its engines run at once, as its registration says): measured
at a light load, λ is that load, not the node's capacity, and a burst after a quiet spell
must not be refused while seats are free. That floor is scaled with the queue allowance
below (seats × ``scale``) while first tokens were late within the last ``horizon_s``:
they show the seats are more than the node can start in time, and at ten times a tiny
model's capacity a fixed floor of 64 seats let the nodes, not the door, refuse four in
five of the 429s. Lateness older than that is no floor: an idle node has no on-time first
tokens to raise the scale with, and a burst after a slow spell found its seats refused.
Past the window the engine's own forecast still refuses what would wait too long.

Little's law bounds the mean wait; the promise is about the tail. ``scale`` adapts by
additive increase, multiplicative decrease (as TCP's window, Netflix's concurrency-limits
or Envoy's adaptive concurrency do), on the wait from the request's arrival here to its
first token, hops included: a first token later than ``LATE`` × ``wait_s`` narrows the
node's queue allowance by ``DECREASE`` (at most once per ``wait_s``, so one slow spell
counts once), each one in time widens it by ``STEP``. With ``STEP`` = ``TAIL`` × (1 −
``DECREASE``) the two balance when about ``TAIL`` of the first tokens are late: the p99
held at twice the wait. ``scale`` stays within [``min_scale``, 1], and only the queue
allowance is scaled: the running part, λ·Ŝ, the node needs to keep its throughput.

Event-loop only; the clock is injectable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.scheduler.cluster import InFlight, Node
from services.scheduler.cluster.registry import DEFAULT_SEATS

Clock = Callable[[], float]

LATE = 2.0  # a first token this many times wait_s after arrival is late (the promise)
DECREASE = 0.9  # a late first token's factor on the window
TAIL = 0.01  # the share of late first tokens the AIMD settles at (a p99)
STEP = TAIL * (1.0 - DECREASE)  # an on-time first token's addition to the scale
REFRESH_S = 0.05  # λ and Ŝ are recomputed at most this often per node
MEMORY = 10.0  # horizons: the time constant a node's measured capacity is forgotten with


@dataclass(frozen=True)
class WindowSettings:
    enabled: bool = False
    wait_s: float = 0.5
    min_window: int = 16
    min_scale: float = 0.25
    horizon_s: float = 2.0


@dataclass
class _NodeWindow:
    scale: float = 1.0
    capacity: float = 0.0  # λ: the highest completion rate measured, decayed since
    held_s: float = 0.0  # Ŝ as last measured (kept through a horizon without completions)
    measured_at: float = -math.inf
    decreased_at: float = -math.inf


def seats_of(node: Node) -> int:
    """The sequences the node's engines run at once (a model that does not say: the
    engine's default)."""
    return sum(m.seats or DEFAULT_SEATS for m in node.info.models)


class NodeWindows:
    """Event-loop only."""

    def __init__(self, settings: WindowSettings, inflight: InFlight,
                 clock: Clock = time.monotonic,
                 report: Callable[[str, int], None] | None = None) -> None:
        """``report(node_id, window)``: told each window as it is computed (a gauge)."""
        self.settings = settings
        self.inflight = inflight
        self.clock = clock
        self.report = report
        self._nodes: dict[str, _NodeWindow] = {}

    def _state(self, node_id: str) -> _NodeWindow:
        w = self._nodes.get(node_id)
        if w is None:
            w = self._nodes[node_id] = _NodeWindow()
        return w

    def window(self, node_id: str, seats: int = 0) -> int:
        """Generations the scheduler lets be in flight on the node now, at least ``seats``
        while its first tokens come in time (0: no limit)."""
        s = self.settings
        if not s.enabled:
            return 0
        w, now = self._state(node_id), self.clock()
        if now - w.measured_at >= REFRESH_S:
            rate, held = self.inflight.served(node_id, s.horizon_s)
            if w.capacity > 0.0:
                w.capacity *= math.exp(-(now - w.measured_at) / (MEMORY * s.horizon_s))
            w.capacity, w.measured_at = max(w.capacity, rate), now
            w.held_s = held if rate > 0.0 else w.held_s
        # (the seats floor follows the scale only while lateness is recent: a node idle
        # since its last late first token has no later evidence to raise the scale with)
        floor = seats if now - w.decreased_at > s.horizon_s else math.ceil(seats * w.scale
                                                                            - 1e-9)
        size = max(s.min_window, floor,
                   math.ceil(w.capacity * (w.held_s + w.scale * s.wait_s) - 1e-9))
        if self.report is not None:
            self.report(node_id, size)
        return size

    def with_room(self, nodes: Iterable[Node]) -> list[Node]:
        """The ``nodes`` whose window is not full (``Node.routed``: the scheduler's count
        of the generations it sent there that have not ended)."""
        if not self.settings.enabled:
            return list(nodes)
        return [n for n in nodes if n.routed < self.window(n.node_id, seats_of(n))]

    def all_full(self, nodes: list[Node]) -> bool:
        """Whether ``nodes`` are some and every one's window is full."""
        return bool(nodes) and self.settings.enabled and not self.with_room(nodes)

    def first_token(self, node_id: str, arrived: float) -> None:
        """A request that arrived at clock time ``arrived`` got its first token from the
        node now: the AIMD step (0.0: its arrival is unknown, not counted)."""
        if not self.settings.enabled or arrived <= 0.0:
            return
        w, now = self._state(node_id), self.clock()
        if now - arrived > LATE * self.settings.wait_s:
            if now - w.decreased_at >= self.settings.wait_s:
                w.scale = max(self.settings.min_scale, w.scale * DECREASE)
                w.decreased_at = now
        else:
            w.scale = min(1.0, w.scale + STEP)

    def scale(self, node_id: str) -> float:
        return self._state(node_id).scale
