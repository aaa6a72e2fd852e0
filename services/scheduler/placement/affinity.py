"""Which node activates a model that runs nowhere it can be used: Tangram's GPU
affinity-aware scheduling (Tangram §3.4, Algorithm 2).

A node that still holds part of a model's weights (an earlier activation's tensors, or
identical ones another model brought) loads only the rest, so nodes differ in how soon
they can answer. Each node reports per model the bytes it holds and its measured load
bandwidth (``shared/model_residency.py``); the expected latency of activating model m on
node g is Eq. 3's load time, t_load = (S - S') / B (S the model's bytes, S' those
reusable on g, B g's measured bandwidth), plus the time g's queue already makes a new
request wait (the paper builds on SLLM's scheduler, whose estimate counts the queue ahead
of the load). The lowest wins (lines 9-10).

Used for an evicted model's first request (``routing/dispatch.py``), an advisory for an
evicted model (``advisory/placement.py``, which warms the model before its request), and
a placement move's target (``loop.py`` checks Algorithm 1's choice against it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.scheduler.cluster import Node, by_kv_pressure

# A node that has not measured its bandwidth yet is assumed as fast as the fastest that
# has; with none measured, every node gets this one (then only the bytes to load differ).
UNMEASURED_BYTES_PER_S = 1e9


@dataclass(frozen=True)
class Estimate:
    node: Node
    total_bytes: int  # S
    missing_bytes: int  # S - S'
    load_s: float  # Eq. 3
    queue_s: float

    @property
    def latency_s(self) -> float:
        return self.queue_s + self.load_s

    @property
    def reuse(self) -> str:
        """How much of the model the node held: "all", "part", "none" or "unknown" (its
        size is known neither to the node nor to the scheduler; a metric label)."""
        if not self.total_bytes:
            return "unknown"
        if not self.missing_bytes:
            return "all"
        return "none" if self.missing_bytes >= self.total_bytes else "part"


def load_time_s(missing_bytes: int, bytes_per_s: float) -> float:
    """Eq. 3: t_load = (S - S') / B."""
    if missing_bytes <= 0:
        return 0.0
    return missing_bytes / bytes_per_s if bytes_per_s > 0 else math.inf


def estimate(model: str, node: Node, total_bytes: int, fallback_bytes_per_s: float
             ) -> Estimate:
    """GetReuseSize (line 7) and EstimateLoadTime (line 8) of ``model`` on ``node``.
    ``total_bytes``: S when the node does not report the model (0: unknown)."""
    r = node.load.residency_of(model)
    # The node's own account when it gives one: a Reuse Store counts the model's distinct
    # engine tensors in the serving dtype, which differ from its files' bytes (headers,
    # dtype, identical tensors held once); S' and S must be in the same units.
    total = r.total_bytes if r is not None and r.total_bytes else total_bytes
    if r is not None and r.active:
        missing = 0
    else:
        missing = max(0, total - (r.resident_bytes if r is not None else 0))
    bw = node.load.load_bytes_per_s or fallback_bytes_per_s
    return Estimate(node, total, missing, load_time_s(missing, bw), node.load.queue_delay_s)


def fallback_bandwidth(nodes: Sequence[Node]) -> float:
    measured = [n.load.load_bytes_per_s for n in nodes if n.load.load_bytes_per_s > 0]
    return max(measured) if measured else UNMEASURED_BYTES_PER_S


def model_bytes(model: str, nodes: Sequence[Node], catalog_bytes: int = 0) -> int:
    """S: the largest total any node reports for ``model``, else the catalogue's size."""
    reported = [r.total_bytes for n in nodes if (r := n.load.residency_of(model)) is not None]
    return max([*reported, catalog_bytes])


def can_run(model: str, node: Node, total_bytes: int) -> bool:
    """CanRun (line 5): the node's device memory can hold the model's weights at all (its
    node manager evicts idle models to make the room); an unknown budget is no limit."""
    budget = node.load.device_budget_bytes
    return not (budget > 0 and total_bytes > budget)


def affinity_schedule(requests: Sequence[str], nodes: Sequence[Node],
                      total_bytes: Callable[[str], int]) -> list[tuple[str, Estimate]]:
    """Algorithm 2 as written: each requested model (in order) to the node of lowest
    expected latency among those that can run it and have not been given one of these
    requests yet; a model no node can run stays out (it waits for the next round).
    ``nodes`` are the available ones (line 1), in tie-break order: the first of equal
    latencies wins (line 9 is a strict <)."""
    gpus = list(nodes)  # line 1
    fallback = fallback_bandwidth(gpus)
    schedules: list[tuple[str, Estimate]] = []
    for m in requests:  # line 2
        size = model_bytes(m, gpus, total_bytes(m))
        best: Estimate | None = None  # line 3
        for g in gpus:  # line 4
            if not can_run(m, g, size):  # lines 5-6
                continue
            est = estimate(m, g, size, fallback)  # lines 7-8
            if best is None or est.latency_s < best.latency_s:  # lines 9-10
                best = est
        if best is not None:  # line 11
            schedules.append((m, best))  # line 12
            gpus.remove(best.node)  # line 13
    return schedules  # line 14


def best_node(model: str, nodes: Sequence[Node], total_bytes: int = 0) -> Estimate | None:
    """Algorithm 2 for one request: where to activate ``model`` (None: no node can).
    Equal latencies go to the node of least KV pressure (Prism §6.2's choice)."""
    chosen = affinity_schedule([model], by_kv_pressure(list(nodes)), lambda _: total_bytes)
    return chosen[0][1] if chosen else None
