"""The test run's cluster secret: the harness's (``bench/harness/secret.py``), set for this
process and, through the environment, for every service a test starts, so the suite's
real processes authenticate their internal traffic as a deployment does."""

from __future__ import annotations

from bench.harness import CLUSTER_SECRET as TEST_SECRET
from bench.harness import sync_channel
from bench.harness import use_cluster_secret as use_test_secret

__all__ = ["TEST_SECRET", "sync_channel", "use_test_secret"]
