"""Tenants are isolated end to end on real processes (two nodes, a shared S3 tier): the
same session id and the same prompt under another API key reuse nothing, from the
device, the other node or S3 (so it cannot be detected by what is cached, nor by
timing: nothing of it is loaded); another tenant's advisory cannot be seen, invalidated
or used; tenants' keys do not open the operator routes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, start_cluster

ALPHA = {"Authorization": "Bearer key-of-alpha"}
BETA = {"Authorization": "Bearer key-of-beta1"}
OPS = {"Authorization": "Bearer key-of-ops99"}
SYSTEM = "You are a careful assistant. " * 30


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = {"anonymous": "false", "api_keys": "key-of-alpha=alpha,key-of-beta1=beta",
             "admin_keys": "key-of-ops99"}
    with start_cluster(tmp_path_factory.mktemp("tenants"), tiny_model, nodes=2, s3=True,
                       scheduler_flags=flags) as c:
        yield c


def _chat(cluster: Cluster, key: dict, session: str, user: str, system: str = SYSTEM
          ) -> tuple[int, str]:
    """(cached tokens, serving node) of one turn."""
    body = {"model": "demo-tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}
    status, answer, headers = cluster.post_with_headers(
        "/v1/chat/completions", body, headers={**key, "X-Session-Id": session})
    assert status == 200, (answer, cluster.logs())
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"], headers["X-Overture-Node"]


def _serve_only(cluster: Cluster, node: str) -> None:
    for n in ("node0", "node1"):
        action = "undrain" if n == node else "drain"
        status, _ = cluster.post_as(OPS, f"/admin/nodes/{n}/{action}")
        assert status == 200


def test_the_same_session_and_prompt_under_another_key_reuse_nothing(cluster: Cluster
                                                                     ) -> None:
    _serve_only(cluster, "node0")
    assert _chat(cluster, ALPHA, "shared", "hello") == (0, "node0")
    cached, _ = _chat(cluster, ALPHA, "shared", "hello")
    assert cached > 0  # alpha's own history is reused
    # Same node, same session id, same prompt: beta starts from nothing (no device hit).
    assert _chat(cluster, BETA, "shared", "hello") == (0, "node0")
    # Another node: a session only alpha has (on node0, durable in S3 by now) is not
    # pulled from node0 or read from S3 for beta.
    other = "A different system prompt, only alpha's. " * 20
    assert _chat(cluster, ALPHA, "alpha-only", "hi", other)[0] == 0
    time.sleep(1.0)
    _serve_only(cluster, "node1")
    assert _chat(cluster, BETA, "alpha-only", "hi", other) == (0, "node1")
    # ...while alpha's session follows it there.
    cached, node = _chat(cluster, ALPHA, "alpha-only", "hi", other)
    assert node == "node1" and cached > 0, cluster.logs()


def test_another_tenants_advisory_cannot_be_seen_used_or_ended(cluster: Cluster) -> None:
    system = "The advisory test's own system prompt. " * 20  # (nobody else sent it)
    _serve_only(cluster, "node0")
    _chat(cluster, ALPHA, "adv", "first", system)
    _serve_only(cluster, "node1")
    status, adv, _ = cluster.post_with_headers(
        "/v1/advisory", {"session_id": "adv", "model": "demo-tiny"}, headers=ALPHA)
    assert status == 202
    status, _ = cluster.delete(f"/v1/advisory/{adv['advisory_id']}", headers=BETA)
    assert status == 404
    # Beta's own advisory for the same session id prefetches nothing of alpha's.
    status, _, _ = cluster.post_with_headers(
        "/v1/advisory", {"session_id": "adv", "model": "demo-tiny"}, headers=BETA)
    assert status == 202
    time.sleep(0.5)
    assert _chat(cluster, BETA, "adv", "first", system)[0] == 0
    status, _ = cluster.delete(f"/v1/advisory/{adv['advisory_id']}", headers=ALPHA)
    assert status == 200


def test_tenant_keys_do_not_open_operator_routes(cluster: Cluster) -> None:
    for method, path in (("GET", "/admin/sessions/shared?tenant=alpha"),
                         ("POST", "/admin/nodes/node0/drain"), ("GET", "/metrics")):
        for key, code in ((BETA, 403), ({}, 401)):
            if method == "GET":
                status, _ = cluster.get(path, headers=key) if path != "/metrics" else (
                    _status_of_text(cluster, path, key), None)
            else:
                status, _ = cluster.post_as(key, path)
            assert status == code, (method, path, key)
    status, where = cluster.get("/admin/sessions/shared?tenant=alpha", headers=OPS)
    assert status == 200 and where["node"] in ("node0", "node1")


def _status_of_text(cluster: Cluster, path: str, key: dict) -> int:
    import urllib.error

    try:
        cluster.text(path, headers=key)
        return 200
    except urllib.error.HTTPError as e:
        return e.code
