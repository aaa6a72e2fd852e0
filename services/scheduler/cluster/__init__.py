"""The scheduler's view of the cluster: the registered nodes and their load
(``registry.py`` over ``node.py``), where each session's KV is (``sessions.py``), and the
gRPC channels to the nodes (``channels.py``). Facts only: the policies decide elsewhere."""

from services.scheduler.cluster.channels import NodeChannels
from services.scheduler.cluster.node import Load, ModelSpec, Node, NodeInfo, least_kv_pressure
from services.scheduler.cluster.registry import HOLDER_SLACK, NodeRegistry
from services.scheduler.cluster.sessions import SessionDirectory, SessionPlace

__all__ = [
    "HOLDER_SLACK", "Load", "ModelSpec", "Node", "NodeChannels", "NodeInfo", "NodeRegistry",
    "SessionDirectory", "SessionPlace", "least_kv_pressure",
]
