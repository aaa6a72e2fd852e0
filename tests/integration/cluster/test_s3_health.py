"""Health that tells the truth about the shared tier (issue 43, finding 7): with the
cluster's S3 server gone, the node keeps serving (its turns are kept locally, later
turns recompute what only S3 had) but ``/readyz`` and ``/admin/nodes`` list it as
degraded, saying S3 is unreachable, without waiting for a request to fail first."""

from __future__ import annotations

import time
from pathlib import Path

from tests.cluster import start_cluster

KVSTORE = {"s3.health_check_s": 0.5, "s3.max_attempts": 1, "s3.timeout_s": 1.0,
           "s3.backoff_max_s": 0.5}
NODEMGR = {"heartbeat_interval_s": 0.2}


def test_an_unreachable_s3_shows_the_node_degraded(tiny_model: Path, tmp_path: Path) -> None:
    with start_cluster(tmp_path, tiny_model, nodes=1, s3=True, kvstore_flags=KVSTORE,
                       nodemgr_flags=NODEMGR) as c:
        deadline = time.monotonic() + 60
        while (body := c.get("/readyz")[1])["nodes"]["node0"]["state"] != "serving":
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
        assert body["degraded_nodes"] == []
        c.kill("s3")
        deadline = time.monotonic() + 60
        while (body := c.get("/readyz")[1])["nodes"]["node0"]["state"] != "degraded":
            assert time.monotonic() < deadline, (body, c.logs())
            time.sleep(0.1)
        assert body["degraded_nodes"] == ["node0"]
        assert "s3" in body["nodes"]["node0"]["degraded"], body
        status, nodes = c.get("/admin/nodes")
        assert status == 200, nodes
        (node,) = nodes["nodes"]
        assert node["in_rotation"] and "s3" in node["degraded"], node
        status, answer = c.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "still serving?"}], "max_tokens": 4,
            "temperature": 0})
        assert status == 200, answer  # degraded, not out
