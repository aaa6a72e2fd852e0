"""The registered nodes and whether each is in rotation.

A node is *in rotation* when it has beaten within ``heartbeat_timeout_s``, reports no
problem, and has not been suspended because a call to it failed as unreachable. Health is
computed from the injectable ``clock`` at the moment of the question, so expiry needs no
background task (``sweep()`` only reports transitions for logs and metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.scheduler.cluster.node import Load, ModelSpec, Node, NodeInfo

Clock = Callable[[], float]

# Heartbeat timeouts a session's KV holder may be late and still be named as the source
# of its KV: a wrong guess costs one bounded peer lookup, a skipped live holder a
# recomputed history.
HOLDER_SLACK = 3.0
DEFAULT_SEATS = 64  # the engine's default max_num_seqs: a model that does not say its seats


class NodeRegistry:
    """Registered nodes keyed by id. Not thread-safe: used from the event loop only."""

    def __init__(self, heartbeat_timeout_s: float, clock: Clock = time.monotonic) -> None:
        self.timeout = heartbeat_timeout_s
        self.clock = clock
        self._nodes: dict[str, Node] = {}
        self._was_up: dict[str, bool] = {}
        self._generation = 0
        self._changed = asyncio.Event()
        self._on_register: list[Callable[[str], None]] = []

    def on_register(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(node_id)`` whenever a node registers (again): what the scheduler
        learned of its caches before is stale (a restarted node's device is empty; its
        kvstore's sessions come with the registration)."""
        self._on_register.append(listener)

    # -- updates ------------------------------------------------------------------------

    def register(self, info: NodeInfo) -> Node:
        """Add or replace a node; a re-registration resets load, keeps in-flight counts."""
        now = self.clock()
        old = self._nodes.get(info.node_id)
        self._generation += 1
        node = Node(
            info,
            registered_at=now,
            last_beat=now,
            routed=old.routed if old else 0,
            drained=old.drained if old else False,  # a restarted drained node stays drained
            # (its pending advisories are still in the book: they end, and uncount, later)
            advised_priority=old.advised_priority if old else 0,
            advised=old.advised if old else 0,
            generation=self._generation,
            leaving=old.leaving if old else set(),
        )
        self._nodes[info.node_id] = node
        for listener in self._on_register:
            listener(info.node_id)
        self._notify()
        return node

    def heartbeat(self, node_id: str, load: Load) -> bool:
        """Record a beat; False when the node is unknown and must register again."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        now = self.clock()
        node.last_beat = now
        node.load = load
        if load.waiting == 0:
            node.behind_until = 0.0  # its queue is empty: it has caught up
        if node.suspended and now >= node.suspended_until and not load.problem:
            node.suspended = False
        self._notify()
        return True

    def suspend(self, node_id: str, grace_s: float, generation: int | None = None) -> None:
        """Take a node out of rotation now (a call to it failed as unreachable).

        Beats that were already on their way when the call failed must not put it back, so
        only a beat arriving ``grace_s`` from now, reporting no problem, ends the suspension.
        With ``generation``, only that registration of the node is suspended.
        """
        node = self._nodes.get(node_id)
        if node is not None and generation in (None, node.generation):
            node.suspended = True
            node.suspended_until = self.clock() + grace_s
            self._notify()

    def mark_behind(self, node_id: str, hold_s: float) -> None:
        """The node refused a request as overloaded: route around it for ``hold_s`` (or
        until a beat says its queue is empty), so that overload costs no round trips."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.behind_until = self.clock() + hold_s

    def behind(self, node: Node) -> bool:
        return self.clock() < node.behind_until

    def set_leaving(self, node_id: str, model: str, leaving: bool) -> None:
        """A placement move is (or no longer is) taking ``model`` away from the node."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        if leaving:
            node.leaving.add(model)
        else:
            node.leaving.discard(model)
        self._notify()

    def drain(self, node_id: str, drained: bool = True) -> Node | None:
        """Stop (or resume) routing new requests to a node; None if unknown."""
        node = self._nodes.get(node_id)
        if node is not None and node.drained != drained:
            node.drained = drained
            self._notify()
        return node

    def remove(self, node_id: str) -> None:
        if self._nodes.pop(node_id, None) is not None:
            self._was_up.pop(node_id, None)
            self._notify()

    def begin(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.routed += 1
            node.last_routed = self.clock()

    def advised_priority(self, node_id: str, delta: int) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.advised_priority = max(0, node.advised_priority + delta)

    def advised_pending(self, node_id: str, delta: int) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.advised = max(0, node.advised + delta)

    def end(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is not None and node.routed > 0:
            node.routed -= 1

    # -- queries ------------------------------------------------------------------------

    def alive(self, node: Node, slack: float = 1.0) -> bool:
        """Beating (within ``slack`` heartbeat timeouts) and reachable: it can serve its
        peers' pulls (even when drained)."""
        return self.clock() - node.last_beat <= self.timeout * slack and not node.suspended

    def silent_s(self, node: Node) -> float:
        """Seconds since the node's last heartbeat."""
        return self.clock() - node.last_beat

    def in_rotation(self, node: Node) -> bool:
        return self.alive(node) and not node.load.problem and not node.drained

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def all(self) -> list[Node]:
        return sorted(self._nodes.values(), key=lambda n: n.node_id)

    def healthy(self, model: str | None = None) -> list[Node]:
        """The nodes in rotation (serving ``model``, if given). A node a placement move is
        taking ``model`` from (``Node.leaving``) is left out while another serves it."""
        nodes = [n for n in self.all()
                 if self.in_rotation(n) and (model is None or n.serves(model))]
        if model is None:
            return nodes
        return [n for n in nodes if model not in n.leaving] or nodes

    def models(self, healthy_only: bool = True) -> list[ModelSpec]:
        """Distinct models (by name) of the nodes, in order of node id."""
        seen: dict[str, ModelSpec] = {}
        for n in self.healthy() if healthy_only else self.all():
            for m in n.info.models:
                seen.setdefault(m.name, m)
        return list(seen.values())

    def seats(self) -> int:
        """Sequences the nodes in rotation run at once (a model that does not say how
        many counts as ``DEFAULT_SEATS``, the engine's default)."""
        return sum(m.seats or DEFAULT_SEATS for n in self.healthy() for m in n.info.models)

    def max_model_len(self, model: str) -> int:
        """The context of ``model`` as a node reported it (0: no node serves it)."""
        return max((m.max_model_len for n in self.all() for m in n.info.models
                    if m.name == model), default=0)

    def sweep(self) -> tuple[list[str], list[str]]:
        """Node ids that (left, joined) rotation since the previous sweep."""
        left: list[str] = []
        joined: list[str] = []
        for n in self.all():
            up = self.in_rotation(n)
            was = self._was_up.get(n.node_id)
            if was is not None and was != up:
                (joined if up else left).append(n.node_id)
            elif was is None and up:
                joined.append(n.node_id)
            self._was_up[n.node_id] = up
        return left, joined

    async def wait_changed(self, timeout: float) -> None:
        """Wait until a node registers, beats or changes state, or ``timeout`` passes."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    def check_integrity(self) -> None:
        for node_id, n in self._nodes.items():
            assert node_id == n.node_id, f"node keyed as {node_id} has id {n.node_id}"
            assert n.routed >= 0, f"node {node_id} has negative in-flight {n.routed}"
            assert n.last_beat >= n.registered_at, f"node {node_id} beat before registering"

    def _notify(self) -> None:
        # Wake every waiter once, then start a fresh event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()
