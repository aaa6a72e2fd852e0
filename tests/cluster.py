"""The tests' name for the cluster harness (``bench/harness``): a real Overture cluster,
each service a process on free loopback ports, stopped at the end whatever happened."""

from __future__ import annotations

from bench.harness import (
    NODEMGR_FLAGS,
    REPO,
    SCHEDULER_FLAGS,
    Cluster,
    Proc,
    restart_scheduler,
    start_cluster,
)

__all__ = ["NODEMGR_FLAGS", "REPO", "SCHEDULER_FLAGS", "Cluster", "Proc", "restart_scheduler",
           "start_cluster"]
