"""prompt_cache_retention on real processes: the scheduler maps OpenAI's two values to
seconds (its config), the engine carries them to its save, the kvstore records them in the
session's manifest and expires the session when its retention runs out (its manifest and
its chunks from every tier), long before the tiers' own TTLs; the next turn after that is
recomputed, token for token the same."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.chunk_codec import chunk_key
from shared.proto import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster import Cluster, start_cluster
from tests.internal import sync_channel

IN_MEMORY_S = 6.0  # the test's "in_memory": seconds (the default is ten minutes)
DAY_S = 3600.0  # the test's "24h", bounded below the kvstore's TTL
KEY = {"Authorization": "Bearer key-of-alpha"}
REF = {"Authorization": "Bearer key-of-refer"}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = {"anonymous": "false", "api_keys": "key-of-alpha=alpha,key-of-refer=refer",
             "retention_in_memory_s": IN_MEMORY_S, "retention_24h_s": DAY_S}
    with start_cluster(tmp_path_factory.mktemp("retention"), tiny_model, ssd=True,
                       scheduler_flags=flags, engine_flags={"offload.policy": "always"},
                       kvstore_flags={"chunk_tokens": 32, "sweep_interval_s": 0.2}) as c:
        yield c


def _body(session: str, retention: str | None, extra: str = "") -> dict[str, Any]:
    system = f"({session}) You keep notes for a long project; answer briefly. " * 10
    return {"model": "demo-tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True, "prompt_cache_key": session,
            **({"prompt_cache_retention": retention} if retention else {}),
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"({session}) the plan{extra}"}]}


def _manifest(cluster: Cluster, session: str) -> kvstore_pb2.SessionManifest | None:
    fp = cluster.engine_status().models[0].fingerprint
    with sync_channel(cluster.kvstore_addresses["node0"]) as ch:
        reply = kvstore_pb2_grpc.KVStoreStub(ch).GetManifest(
            kvstore_pb2.ManifestRef(tenant="alpha", session_id=session, model_fp=fp),
            timeout=10)
    return reply.manifest if reply.found else None


def _keys(m: kvstore_pb2.SessionManifest) -> set[str]:
    bpc, hashes = m.blocks_per_chunk, list(m.block_hashes)
    return {chunk_key(m.tenant, m.model_fp, hashes[min(s + bpc, len(hashes)) - 1], layer)
            for layer in range(m.num_layers) for s in range(0, len(hashes), bpc)}


def _held(cluster: Cluster, keys: set[str]) -> list[str]:
    """The tiers holding any of the chunks ``keys``."""
    with sync_channel(cluster.kvstore_addresses["node0"]) as ch:
        reply = kvstore_pb2_grpc.KVStoreStub(ch).Stat(
            kvstore_pb2.StatRequest(keys=sorted(keys)), timeout=10)
    return [t for k in reply.keys for t in k.tiers]


def _wait(what: Any, cluster: Cluster, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    return got


def test_prompt_cache_retention_changes_the_ttl_the_kvstore_records(cluster: Cluster) -> None:
    answers = {}
    for session, retention in (("ret-short", "in_memory"), ("ret-long", "24h"),
                               ("ret-none", None)):
        status, answers[session] = cluster.post_as(KEY, "/v1/chat/completions",
                                                   _body(session, retention))
        assert status == 200, answers[session]
    status, resp = cluster.post_as(KEY, "/v1/responses", {
        "model": "demo-tiny", "input": "(ret-resp) the plan", "max_output_tokens": 4,
        "prompt_cache_key": "ret-resp", "prompt_cache_retention": "24h"})
    assert status == 200, resp
    recorded = {s: _wait(lambda s=s: _manifest(cluster, s), cluster).retain_s
                for s in ("ret-short", "ret-long", "ret-none", "ret-resp")}
    assert recorded == {"ret-short": IN_MEMORY_S, "ret-long": DAY_S, "ret-none": 0.0,
                        "ret-resp": DAY_S}, recorded
    kept = {s: _keys(_manifest(cluster, s)) for s in ("ret-long", "ret-none", "ret-resp")}
    # its own chunks: not those every session's chat template starts with (read since)
    own = _keys(_manifest(cluster, "ret-short")).difference(*kept.values())
    assert own and len(_held(cluster, own)) == 2 * len(own)  # in DRAM and on SSD
    # "in_memory" runs out after IN_MEMORY_S: the session and its own chunks go, from
    # every tier (the tiers' own TTLs are a day and a week); the others stay.
    _wait(lambda: _manifest(cluster, "ret-short") is None, cluster)
    _wait(lambda: not _held(cluster, own), cluster)
    assert all(_manifest(cluster, s) is not None for s in kept)
    assert len(_held(cluster, kept["ret-long"])) == 2 * len(kept["ret-long"])
    # the next turn recomputes what was dropped: the same tokens as a tenant with nothing
    body = _body("ret-short", "in_memory", " again")
    status, again = cluster.post_as(KEY, "/v1/chat/completions", body)
    assert status == 200, again
    status, ref = cluster.post_as(REF, "/v1/chat/completions", {**body,
                                                                "prompt_cache_key": "r"})
    assert status == 200 and ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
