"""Node manager: the node's control plane (registration and heartbeats, requests routed to
the engine of their model, advisories prefetched, models activated and evicted, the node's
device budget brokered between its engines)."""

from services.nodemgr.app import run
from services.nodemgr.config import NodeManagerConfig

__all__ = ["NodeManagerConfig", "run"]
