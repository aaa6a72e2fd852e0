"""The queue of activations Tangram's Algorithm 2 schedules (Tangram §3.4).

Algorithm 2 does not place one request at a time: it takes the sequence of pending model
requests, enumerates the available GPUs (line 1), gives each request in turn the GPU of
lowest expected latency (lines 2-10), and removes that GPU from the pool (line 13), so two
models that would both prefer the node holding their tensors do not both go there; a
request no available GPU can take stays queued for the next round (lines 11-12).

Here the requests are those for evicted models (active on no node) that the dispatcher
holds, in the order they came; a node is available while no activation it was given is
under way (from its choice until the model shows active in a heartbeat, or ``hold_s``
passes). Each request asks in its turn: the queue ahead of it is scheduled first (those
models take their nodes out of the pool, without being committed: they commit when their
own request asks), then it gets the best node left, or waits.

One difference from the paper: its GPU runs one model, where a node here has an engine
pool and its own activation queue (the nodemgr's Activator). A request that has waited
past ``wait=False`` (half its dispatch deadline: the dispatcher's choice) takes the best
node among all, busy or not, instead of failing with a 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from services.scheduler.cluster import Node, by_kv_pressure
from services.scheduler.placement.affinity import Estimate, affinity_schedule

# How long a node stays given to an activation that never shows up as active (it failed,
# or its request gave up): then the node is available again.
HOLD_S = 30.0


class ActivationQueue:
    def __init__(self, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._waiting: dict[str, float] = {}  # model -> when its first request asked
        self._activating: dict[str, tuple[str, float]] = {}  # model -> (node id, since)

    def choose(self, model: str, nodes: Sequence[Node], total_bytes: Callable[[str], int],
               active: Callable[[str], bool], wait: bool = True) -> Estimate | None:
        """The node to activate ``model`` on, from ``nodes`` (the free healthy ones); None:
        it stays queued (every node that could take it is given to an activation ahead
        of it). ``active(m)``: some node serves m now (its activation is done)."""
        now = self._clock()
        self._prune(now, active)
        held = self._activating.get(model)
        if held is not None:  # (its activation is under way: its requests go together)
            node = next((n for n in nodes if n.node_id == held[0]), None)
            if node is not None:
                return affinity_schedule([model], [node], total_bytes)[0][1]
            del self._activating[model]  # (its node left or is behind: choose again)
        self._waiting.setdefault(model, now)
        busy = {node_id for node_id, _ in self._activating.values()}
        gpus = by_kv_pressure([n for n in nodes if n.node_id not in busy])  # line 1
        queue = sorted(self._waiting, key=lambda m: (self._waiting[m], m))
        ahead = queue[:queue.index(model) + 1]
        chosen = dict(affinity_schedule(ahead, gpus, total_bytes))  # lines 2-14
        est = chosen.get(model)
        if est is None and not wait:  # (see the module's note)
            scheduled = affinity_schedule([model], by_kv_pressure(list(nodes)), total_bytes)
            est = scheduled[0][1] if scheduled else None
        if est is not None:
            del self._waiting[model]
            self._activating[model] = (est.node.node_id, now)
        return est

    def pending(self) -> list[str]:
        """The queued models, first come first."""
        return sorted(self._waiting, key=lambda m: (self._waiting[m], m))

    def activating(self) -> dict[str, str]:
        """Model -> the node its activation was given to."""
        return {m: node_id for m, (node_id, _) in self._activating.items()}

    def _prune(self, now: float, active: Callable[[str], bool]) -> None:
        for m, (_, since) in list(self._activating.items()):
            if active(m) or now - since > self.hold_s:
                del self._activating[m]
        for m, since in list(self._waiting.items()):
            if active(m) or now - since > self.hold_s:
                del self._waiting[m]
