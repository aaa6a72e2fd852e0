"""The scheduler's view of the cluster: the registered nodes and their load
(``registry.py`` over ``node.py``), the generations running on them and when each should
end (``inflight.py``), where each session's KV is (``sessions.py``), which nodes hold a
prompt's leading context (``prefixes.py``, keyed by ``prefix_hashes.py``), the session of
each tool call (``tool_calls.py``), and the gRPC channels to the nodes (``channels.py``).
Facts only: the policies decide elsewhere."""

from services.scheduler.cluster.channels import NodeChannels
from services.scheduler.cluster.inflight import InFlight
from services.scheduler.cluster.node import (
    Load,
    ModelSpec,
    Node,
    NodeInfo,
    by_kv_pressure,
    least_kv_pressure,
)
from services.scheduler.cluster.prefix_hashes import (
    BLOCK_CHARS,
    block_hashes,
    prompt_prefix,
    prompt_text,
    request_hashes,
)
from services.scheduler.cluster.prefixes import PrefixIndex
from services.scheduler.cluster.registry import HOLDER_SLACK, NodeRegistry
from services.scheduler.cluster.sessions import SessionDirectory, SessionPlace
from services.scheduler.cluster.tool_calls import ToolCallSessions

__all__ = [
    "BLOCK_CHARS",
    "HOLDER_SLACK",
    "InFlight",
    "Load",
    "ModelSpec",
    "Node",
    "NodeChannels",
    "NodeInfo",
    "NodeRegistry",
    "PrefixIndex",
    "SessionDirectory",
    "SessionPlace",
    "ToolCallSessions",
    "block_hashes",
    "by_kv_pressure",
    "least_kv_pressure",
    "prompt_prefix",
    "prompt_text",
    "request_hashes",
]
