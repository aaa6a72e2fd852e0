"""A session's turns on a two-node harness cluster, for the benches that time a turn by
where its history's KV is (``resume``, ``advisory_ttft``): the token ids of a history,
a timed one-token completion, which node serves, the kvstores settled, a session's KV
left only in S3, an engine's device cache dropped.

The kvstore and engine calls go through the harness's ``sync_channel``: the cluster's
services refuse internal calls without its token.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.harness import Cluster, sync_channel
from shared.proto import engine_pb2, engine_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

NEW_MESSAGE_TOKENS = 50
# Token ids are drawn from here (away from the special tokens), within the model's vocabulary.
VOCAB = (300, 16000)
TENANT = "default"


def token_range(model: Path) -> tuple[int, int]:
    """``VOCAB``, cut to ``model``'s vocabulary (a tiny demo model has 1024 tokens)."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    return VOCAB[0], min(VOCAB[1], vocab)


def complete(cluster: Cluster, ids: list[int], session: str) -> tuple[float, dict, str]:
    """(seconds, usage, serving node) of a one-token completion of ``ids``."""
    body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(cluster.url + "/v1/completions", data=body, headers={
        "Content-Type": "application/json", "X-Session-Id": session})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
        node = r.headers.get("X-Overture-Node", "")
    return time.perf_counter() - t0, answer["usage"], node


def serve_only(cluster: Cluster, node: str) -> None:
    """Drain every node but ``node``; wait until it is the only one in rotation."""
    for n in ("node0", "node1"):
        cluster.post(f"/admin/nodes/{n}/{'undrain' if n == node else 'drain'}", {})
    deadline = time.monotonic() + 30
    while cluster.get("/readyz")[1].get("healthy_nodes") != [node]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{node} did not become the only node in rotation")
        time.sleep(0.05)


def drop_device_cache(cluster: Cluster, node: str) -> None:
    with sync_channel(cluster.engine_addresses[node]) as ch:
        engine_pb2_grpc.EngineStub(ch).DropDeviceCache(engine_pb2.DropDeviceCacheRequest(),
                                                       timeout=30)


@contextlib.contextmanager
def _kvstore(cluster: Cluster, node: str) -> Iterator[Any]:
    with sync_channel(cluster.kvstore_addresses[node]) as channel:
        yield kvstore_pb2_grpc.KVStoreStub(channel)


def settled(cluster: Cluster, session: str) -> None:
    """Wait until both kvstores have written everything behind and node0's manifest of
    ``session`` is durable: no S3 upload competes with the timed turn for the 2 cores."""
    deadline = time.monotonic() + 120
    for node in ("node0", "node1"):
        with _kvstore(cluster, node) as stub:
            while True:
                st = stub.Status(kvstore_pb2.KVStoreStatusRequest(), timeout=10)
                found = node != "node0" or not session or stub.GetManifest(
                    kvstore_pb2.ManifestRef(tenant=TENANT, session_id=session),
                    timeout=10).found
                if st.write_queue_depth == 0 and found:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the kvstores did not settle within 120 s")
                time.sleep(0.05)


def only_in_s3(cluster: Cluster, session: str) -> None:
    """Delete node0's local copies of a session that is durable in S3."""
    with _kvstore(cluster, "node0") as stub:
        stub.Delete(kvstore_pb2.DeleteRequest(
            session=kvstore_pb2.ManifestRef(tenant=TENANT, session_id=session),
            with_chunks=True, tiers=["dram", "ssd"]), timeout=30)
