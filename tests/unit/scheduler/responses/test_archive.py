"""Stored responses outlive the scheduler process: a new store over the same archive
(local disk, or an S3 bucket) resolves what the old one stored, per tenant, until it
expires; ids that are not this scheduler's never reach a file name or a key."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from services.scheduler.api import ApiError, Message, ToolCall
from services.scheduler.responses import ResponseStore
from services.scheduler.responses.archive import ArchiveUnavailable, DiskArchive
from services.scheduler.responses.s3_archive import S3Archive
from shared.s3_config import S3Config

RID = "resp_" + "ab" * 16
CHAT = (Message("user", "hi"),
        Message("assistant", "", (ToolCall("call_1", "f", '{"x": 1}'),)),
        Message("tool", "one", tool_call_id="call_1"))


async def test_a_new_store_over_the_same_folder_resolves_what_the_old_one_stored(
        tmp_path: Path) -> None:
    now = [1000.0]
    old = ResponseStore(10.0, 5, clock=lambda: now[0], archive=DiskArchive(tmp_path))
    await old.put("acme", {"id": RID, "object": "response"}, CHAT, "sess-1")
    new = ResponseStore(10.0, 5, clock=lambda: now[0], archive=DiskArchive(tmp_path))
    got = await new.get("acme", RID)
    assert got is not None
    assert got.body == {"id": RID, "object": "response"}
    assert got.messages == CHAT and got.session_id == "sess-1"
    assert await new.get("other", RID) is None  # another tenant's
    files = list(tmp_path.rglob("*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
    now[0] = 1011.0
    third = ResponseStore(10.0, 5, clock=lambda: now[0], archive=DiskArchive(tmp_path))
    assert await third.get("acme", RID) is None  # expired, and removed
    assert not list(tmp_path.rglob("*.json"))


async def test_delete_reaches_the_archive_and_odd_ids_never_touch_it(tmp_path: Path) -> None:
    store = ResponseStore(10.0, 5, archive=DiskArchive(tmp_path))
    await store.put("acme", {"id": RID}, CHAT, "s")
    fresh = ResponseStore(10.0, 5, archive=DiskArchive(tmp_path))
    assert await fresh.delete("acme", RID) and not await fresh.delete("acme", RID)
    assert await ResponseStore(10.0, 5, archive=DiskArchive(tmp_path)).get("acme", RID) is None
    assert await fresh.get("acme", "../../etc/passwd") is None
    assert await fresh.get("../..", RID) is None
    assert not list(tmp_path.parent.glob("passwd"))


async def test_an_unreadable_archive_is_a_503_not_a_404(tmp_path: Path) -> None:
    class Broken(DiskArchive):
        def load(self, tenant: str, response_id: str) -> bytes | None:
            raise ArchiveUnavailable("disk gone")

    store = ResponseStore(10.0, 5, archive=Broken(tmp_path))
    with pytest.raises(ApiError) as e:
        await store.get("acme", RID)
    assert e.value.status == 503


class FakeS3:
    """The three calls of boto3's S3 client the archive makes, over a dict."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}

    def put_object(self, Bucket: str, Key: str, Body: bytes) -> None:
        self.objects[Bucket, Key] = Body

    def get_object(self, Bucket: str, Key: str) -> dict:
        if (Bucket, Key) not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return {"Body": io.BytesIO(self.objects[Bucket, Key])}

    def delete_object(self, Bucket: str, Key: str) -> None:
        self.objects.pop((Bucket, Key), None)


async def test_the_s3_archive_keeps_records_under_the_tenant() -> None:
    s3 = FakeS3()
    cfg = S3Config(bucket="kv", prefix="ov/")
    await ResponseStore(10.0, 5, archive=S3Archive(cfg, s3)).put("acme", {"id": RID}, CHAT, "s")
    assert list(s3.objects) == [("kv", f"ov/acme/responses/{RID}.json")]
    fresh = ResponseStore(10.0, 5, archive=S3Archive(cfg, s3))
    got = await fresh.get("acme", RID)
    assert got is not None and got.messages == CHAT
    assert await fresh.get("other", RID) is None
    assert await fresh.delete("acme", RID) and not s3.objects


async def test_an_s3_outage_is_a_503_and_a_put_stays_in_memory() -> None:
    class Down(FakeS3):
        def put_object(self, Bucket: str, Key: str, Body: bytes) -> None:
            raise EndpointConnectionError(endpoint_url="http://s3")

        def get_object(self, Bucket: str, Key: str) -> dict:
            raise EndpointConnectionError(endpoint_url="http://s3")

    store = ResponseStore(10.0, 5, archive=S3Archive(S3Config(bucket="kv"), Down()))
    await store.put("acme", {"id": RID}, CHAT, "s")
    assert await store.get("acme", RID) is not None  # from memory
    with pytest.raises(ApiError) as e:
        await store.get("acme", "resp_" + "cd" * 16)
    assert e.value.status == 503
