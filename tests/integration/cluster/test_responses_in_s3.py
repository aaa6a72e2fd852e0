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
