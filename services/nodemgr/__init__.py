"""Node manager: the node's control plane (registration, heartbeats, routing to the engine)."""

from services.nodemgr.app import run
from services.nodemgr.config import NodeManagerConfig

__all__ = ["NodeManagerConfig", "run"]
