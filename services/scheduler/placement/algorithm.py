"""Which node each model runs on: Prism's global model placement by KV pressure (Prism
§6.2, Algorithm 1).

A node's KV pressure ratio is KVPR = w_req_rate / shared_kv: the SLO-weighted request rate
(sum of r_j / s_j) of the models placed on it over the device memory left for KV once their
weights are in. Models are taken in descending r_j / s_j; each goes to the node of least
KVPR, unless it already runs somewhere whose KVPR is within τ of that best, where it stays
(a migration costs an engine switch and a weight load; line 8). The largest KVPR this
gives is bounded by the optimal placement's (Prism appendix A.1, after Graham).

As written, the paper's GPUs all have capacity C; here each node brings its own budget.
A node whose memory is used up (shared_kv <= 0) has infinite pressure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDemand:
    name: str
    request_rate: float  # r_j, requests/s measured
    weight_bytes: int  # w_j
    ttft_slo_s: float  # s_j
    current: str | None = None  # g_j: the node it runs on now (None: evicted/new)

    @property
    def weighted_rate(self) -> float:
        return self.request_rate / self.ttft_slo_s


def kvpr(weighted_rate: float, shared_kv: float) -> float:
    if shared_kv <= 0:
        return math.inf
    return weighted_rate / shared_kv


def place_models(models: Sequence[ModelDemand], capacity: Mapping[str, int],
                 tau: float, load_s: Callable[[str, str], float] | None = None
                 ) -> dict[str, str]:
    """Model name -> node id (Algorithm 1); ``capacity``: each node's device bytes (C).
    ``load_s(model, node)``: the time to activate the model there (Tangram Eq. 3), which
    breaks line 5's ties between nodes of equal KV pressure (idle nodes all have 0)."""
    def tie(model: str, node: str) -> float:
        return load_s(model, node) if load_s is not None else 0.0

    if not capacity:
        return {}
    order = sorted(models, key=lambda m: m.weighted_rate, reverse=True)  # line 1
    nodes = list(capacity)  # (ties go to the first node listed)
    shared = {n: float(capacity[n]) for n in nodes}  # lines 2-3
    w_req = dict.fromkeys(nodes, 0.0)
    placement: dict[str, str] = {}
    for m in order:  # line 4
        best = min(nodes, key=lambda n: (kvpr(w_req[n], shared[n]), tie(m.name, n)))  # line 5
        best_r = kvpr(w_req[best], shared[best])
        chosen = best
        if m.current in shared:
            current_r = kvpr(w_req[m.current], shared[m.current])  # line 6
            if not current_r - best_r > tau:  # line 7 (inf - inf is nan: stay)
                chosen = m.current
        placement[m.name] = chosen  # line 9
        w_req[chosen] += m.weighted_rate  # line 11
        shared[chosen] -= m.weight_bytes  # line 12
    return placement


def max_kvpr(models: Sequence[ModelDemand], capacity: Mapping[str, int],
             placement: Mapping[str, str]) -> float:
    """The largest KVPR over nodes under ``placement`` (what Algorithm 1 keeps low)."""
    w_req = dict.fromkeys(capacity, 0.0)
    shared = {n: float(c) for n, c in capacity.items()}
    for m in models:
        node = placement[m.name]
        w_req[node] += m.weighted_rate
        shared[node] -= m.weight_bytes
    return max(kvpr(w_req[n], shared[n]) for n in capacity)
