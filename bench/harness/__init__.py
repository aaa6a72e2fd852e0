"""The one cluster harness of the benches and the tests: real processes on free loopback
ports, their logs kept, every one stopped at the end whatever happened.

Two ways to start a cluster, both handing back a ``Cluster`` (its URL, HTTP helpers, its
processes and logs):

- ``start_cluster``: every service a process of this harness (a scheduler, per node a
  kvstore, an engine per model and a node manager, optionally a SeaweedFS S3 server),
  each given its flags directly; ``start_scheduler``: a scheduler alone;
  ``restart_scheduler``: the cluster's scheduler again, after a kill.
- ``overture_up``: ``overture up`` as a user runs it, with a demo model.

Clusters run with the harness's cluster secret (``use_cluster_secret``); a direct gRPC
call to one of their services goes through ``sync_channel``, which carries its token.
``start_s3_server`` starts an S3 endpoint alone, ``start_service`` one service alone.
"""

from __future__ import annotations

from bench.harness.by_service import (
    NODEMGR_FLAGS,
    SCHEDULER_FLAGS,
    restart_scheduler,
    start_cluster,
    start_scheduler,
)
from bench.harness.cluster import Cluster
from bench.harness.processes import REPO, Proc, start_service, stop_processes
from bench.harness.s3 import start_s3_server
from bench.harness.secret import (
    CLUSTER_SECRET,
    aws_keys,
    cluster_s3_credentials,
    s3_keys,
    sync_channel,
    use_cluster_secret,
)
from bench.harness.up import overture_up, show_progress
from services.local_cluster import free_port

__all__ = [
    "CLUSTER_SECRET",
    "NODEMGR_FLAGS",
    "REPO",
    "SCHEDULER_FLAGS",
    "Cluster",
    "Proc",
    "aws_keys",
    "cluster_s3_credentials",
    "free_port",
    "overture_up",
    "restart_scheduler",
    "s3_keys",
    "show_progress",
    "start_cluster",
    "start_s3_server",
    "start_scheduler",
    "start_service",
    "stop_processes",
    "sync_channel",
    "use_cluster_secret",
]
