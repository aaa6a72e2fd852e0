"""Stored responses in a real S3 server (SeaweedFS, as ``overture up`` runs it): what one
scheduler process stored, another reads (a restart, or the standby replica taking over),
under the tenant in the kvstores' bucket; with the server down, reads are a 503."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import boto3
import pytest

from bench.harness import s3_keys, start_s3_server
from services.scheduler.api import ApiError, Message
from services.scheduler.responses import ResponseStore
from services.scheduler.responses.s3_archive import S3Archive, s3_client_kwargs
from shared.config import build
from shared.s3_config import S3Config

pytestmark = pytest.mark.slow

RID = "resp_" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    url, stop = start_s3_server()
    try:
        yield url
    finally:
        stop()


def config(endpoint: str, bucket: str) -> S3Config:
    return build(S3Config, {"endpoint_url": endpoint, "bucket": bucket, "prefix": "ovt/",
                            **s3_keys(),
                            "max_attempts": 1, "timeout_s": 1.0})


async def test_a_second_scheduler_reads_what_the_first_stored(endpoint: str) -> None:
    cfg = config(endpoint, f"kv-{uuid.uuid4().hex[:12]}")
    boto3.client("s3", **s3_client_kwargs(cfg)).create_bucket(Bucket=cfg.bucket)
    chat = (Message("user", "Where is Paris?"), Message("assistant", "In France."))
    first = ResponseStore(60.0, 10, archive=S3Archive(cfg))
    await first.put("team-a", {"id": RID, "object": "response"}, chat, "sess-1")

    second = ResponseStore(60.0, 10, archive=S3Archive(cfg))
    got = await second.get("team-a", RID)
    assert got is not None and got.messages == chat and got.session_id == "sess-1"
    assert await second.get("team-b", RID) is None
    keys = [o["Key"] for o in boto3.client("s3", **s3_client_kwargs(cfg)).list_objects_v2(
        Bucket=cfg.bucket)["Contents"]]
    assert keys == [f"ovt/team-a/responses/{RID}.json"]
    assert await second.delete("team-a", RID)
    assert await ResponseStore(60.0, 10, archive=S3Archive(cfg)).get("team-a", RID) is None


async def test_an_unreachable_bucket_is_a_503() -> None:
    cfg = config("http://127.0.0.1:9", "kv-none")  # nothing listens there
    with pytest.raises(ApiError) as e:
        await ResponseStore(60.0, 10, archive=S3Archive(cfg)).get("team-a", RID)
    assert e.value.status == 503


async def test_a_bounded_sweep_deletes_the_expired_responses_and_nothing_else(
        endpoint: str) -> None:
    # Responses past their retention were never deleted from S3 (issue 43): the sweep
    # deletes them, reading at most sweep_max records per sweep and resuming where it
    # stopped, and leaves the fresh ones and the tenants' KV objects beside them.
    cfg = config(endpoint, f"kv-{uuid.uuid4().hex[:12]}")
    s3 = boto3.client("s3", **s3_client_kwargs(cfg))
    s3.create_bucket(Bucket=cfg.bucket)
    now = [1000.0]
    store = ResponseStore(10.0, 100, clock=lambda: now[0],
                          archive=S3Archive(cfg, sweep_max=2))
    chat = (Message("user", "hi"),)
    old = {("team-a", f"resp_{i:032x}") for i in range(3)} | {("team-b", f"resp_{9:032x}")}
    for tenant, rid in sorted(old):
        await store.put(tenant, {"id": rid, "object": "response"}, chat, "s")
    now[0] = 1008.0
    fresh = ("team-b", f"resp_{10:032x}")
    await store.put(*fresh[:1], {"id": fresh[1], "object": "response"}, chat, "s")
    kv_key = "ovt/team-a/fp0123/chunk/0"
    s3.put_object(Bucket=cfg.bucket, Key=kv_key, Body=b"kv")
    now[0] = 1012.0  # the first four are past their 10 s, the fifth is not

    def keys() -> set[str]:
        return {o["Key"] for o in s3.list_objects_v2(Bucket=cfg.bucket).get("Contents", [])}

    archive = store.archive
    sweeps = [archive.sweep(store.expired) for _ in range(3)]
    assert sweeps[0] <= 2 and sweeps[1] <= 2  # bounded: at most two read per sweep
    assert sum(sweeps) == 4
    assert keys() == {kv_key, f"ovt/team-b/responses/{fresh[1]}.json"}
    assert await store.get(*fresh) is not None
    now[0] = 1030.0
    assert sum(archive.sweep(store.expired) for _ in range(3)) == 1
    assert keys() == {kv_key}
