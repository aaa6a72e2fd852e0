"""Overture's Python client: chat under a session, advisories, and agent call graphs.

    from overture_client import Overture, AsyncOverture, AgentGraph
"""

from overture_client.agent_graph import END, AgentGraph
from overture_client.client import (
    Advisory,
    AsyncOverture,
    ChatResult,
    Event,
    Overture,
    OvertureError,
)

__all__ = ["END", "Advisory", "AgentGraph", "AsyncOverture", "ChatResult", "Event", "Overture",
           "OvertureError"]
