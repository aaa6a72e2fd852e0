"""A node as the scheduler knows it: what it said when it registered (``NodeInfo``), what
its last heartbeat reported (``Load``), and what the scheduler itself counts on it (requests
routed, advisories pending). ``least_kv_pressure`` picks the node to activate a model on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    name: str
    fingerprint: str = ""
    max_model_len: int = 0
    dtype: str = ""
    seats: int = 0  # sequences its engine runs at once (0: not said)


@dataclass(frozen=True)
class NodeInfo:
    """What a node says about itself when it registers."""

    node_id: str
    address: str
    models: tuple[ModelSpec, ...]
    kvstore_address: str = ""
    # service -> host:port of its /metrics ("nodemgr", "kvstore", "engine"...)
    metrics: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Load:
    """What a node reports in each heartbeat."""

    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    problem: str = ""
    degraded: str = ""  # a part of the node is down but it serves (e.g. by recompute)
    queue_delay_s: float = 0.0
    # The engine's device prefetch, cumulative: bytes loaded, bytes wasted, purged blocks
    # by layer; and advised sessions held now.
    prefetch_loaded_bytes: int = 0
    prefetch_wasted_bytes: int = 0
    prefetch_purged_by_layer: tuple[int, ...] = ()
    prefetch_sessions: int = 0
    device_budget_bytes: int = 0  # the node's device memory (model placement's capacity)


@dataclass
class Node:
    info: NodeInfo
    registered_at: float
    last_beat: float
    load: Load = field(default_factory=Load)
    routed: int = 0  # requests the scheduler sent here that have not finished yet
    suspended_until: float = 0.0  # after an UNAVAILABLE call: beats before this are stale
    suspended: bool = False
    last_routed: float = 0.0
    drained: bool = False  # an operator stopped new requests to it (it still serves pulls)
    behind_until: float = 0.0  # it refused a request as overloaded: skipped until then
    advised_priority: int = 0  # pending high-priority advisories placed here
    advised: int = 0  # pending advisories of any priority placed here: requests to come
    generation: int = 0  # bumps on every registration, so late news of an old one is ignored

    @property
    def node_id(self) -> str:
        return self.info.node_id

    def serves(self, model: str) -> bool:
        return any(m.name == model for m in self.info.models)

    def score(self) -> int:
        """Load as the policy sees it: engine work plus what the scheduler has in flight."""
        return self.load.running + self.load.waiting + self.routed

    def expected(self) -> int:
        """Load expected when advised requests arrive: ``score`` plus the advisories placed
        here and not yet followed (each is a request on its way, Symphony §3.3). Placing
        by ``score`` alone sends every advisory made while a node is idle to that node."""
        return self.score() + self.advised

    def expected_at(self, gone: int) -> int:
        """``expected`` at an advised request's arrival, when ``gone`` of the load counted
        now will have left (``AdvisoryPlacement.gone``)."""
        return max(0, self.expected() - gone)


def least_kv_pressure(nodes: list[Node]) -> Node | None:
    """The node to activate an evicted model on (Prism §6.2: "the GPU with the lowest KV
    pressure ratio"): the least work per free KV block, as the nodes last reported."""
    if not nodes:
        return None
    return min(nodes, key=lambda n: ((n.score() + n.advised + 1) / max(n.load.blocks_free, 1),
                                     n.node_id))
