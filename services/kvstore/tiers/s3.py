"""S3 tier: the durable, shared home of every chunk, via boto3 against any endpoint.

Every boto3 call runs on the tier's own executor (boto3 is blocking), with its own
retry loop: exponential backoff from ``backoff_s`` doubling up to ``backoff_max_s`` over
``max_attempts`` attempts, for connection errors, timeouts, throttling and 5xx replies.
A call that still fails raises ``TierUnavailable`` and marks the tier *degraded* until the
next successful call. While degraded the tier is a circuit breaker: one call at a time
probes the endpoint (a single attempt), at most once per pause (doubling from
``backoff_s`` up to ``backoff_max_s``), and every other call fails at once. So callers fall
back to local tiers rather than wait on a dead endpoint, and the write-behind's retries
cost a dead endpoint one request per pause instead of a steady stream.

Reads for a check (``get_many_checked``: a load's chunks) go by ranges of
``range_bytes`` (``s3_ranges.py``): the first range tells the object's size, the rest
arrive in parallel straight where the check puts them. ``get`` reads a whole object.

Expiry: ``scan_expired`` lists objects whose LastModified is older than the cut-off; the
store deletes them (a bucket lifecycle rule would be equivalent but is not available on
every endpoint).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from services.kvstore.config import S3Config
from services.kvstore.errors import TierUnavailable
from services.kvstore.tiers.base import (
    Blob,
    Checked,
    Stored,
    T,
    Tier,
    TierStats,
    apply_check,
    whole_blob,
)
from services.kvstore.tiers.s3_ranges import RangedReads, RangeFailed, S3Stored, content_size
from shared.s3_credentials import boto_keys

log = logging.getLogger(__name__)

_MISSING = {"NoSuchKey", "404", "NotFound"}
_RETRYABLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "502",
    "503",
    "504",
}


class S3Tier(Tier):
    name = "s3"
    remote = True

    def __init__(self, cfg: S3Config, range_bytes: int = 0) -> None:
        """``range_bytes``: checked reads fetch an object by ranges of this many bytes in
        parallel (0: one GET per object)."""
        self.cfg = cfg
        self.range_bytes = range_bytes
        self._client: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._range_executor: ThreadPoolExecutor | None = None
        self._ranges: RangedReads | None = None
        self._degraded = ""
        self._next_probe = 0.0  # while degraded: no call reaches the endpoint before this
        self._probe_pause = 0.0
        self._bucket_ready = False
        self._last_answer = 0.0  # monotonic time of the endpoint's last answer
        self.bytes_used = 0  # bytes this process wrote (a bucket has no cheap size query)
        self._closing = threading.Event()  # set by close(): retry loops stop between tries

    @property
    def degraded(self) -> str:
        """Why the tier is degraded, or "" when the last call succeeded."""
        return self._degraded

    async def open(self) -> None:
        self._executor = ThreadPoolExecutor(self.cfg.threads, thread_name_prefix="kv-s3")
        if self.range_bytes:
            self._range_executor = ThreadPoolExecutor(self.cfg.threads,
                                                      thread_name_prefix="kv-s3-range")
            self._ranges = RangedReads(self._get_range_blocking, self.range_bytes,
                                       self._range_executor, self._closing)
        kwargs: dict[str, Any] = {
            "region_name": self.cfg.region,
            "config": BotoConfig(
                retries={"max_attempts": 1, "mode": "standard"},
                connect_timeout=self.cfg.timeout_s,
                read_timeout=self.cfg.timeout_s,
                max_pool_connections=self.cfg.threads * 3,  # (the ranges' threads too)
            ),
        }
        if self.cfg.endpoint_url:
            kwargs["endpoint_url"] = self.cfg.endpoint_url
        kwargs.update(boto_keys(self.cfg))
        # Creating a client loads botocore's service models: slow, so off the loop too.
        self._client = await self._run(lambda: boto3.session.Session().client("s3", **kwargs))
        try:
            await self._call(self._ensure_bucket_blocking)
        except TierUnavailable as e:
            log.warning("s3 unreachable at start, continuing degraded: %s", e)

    async def close(self) -> None:
        """Stop retrying, drop queued calls, and wait (off the loop, at most about one call's
        timeout) for the calls under way: a hung endpoint must not stall the event loop or
        hold shutdown far past ``drain_s``."""
        executor, self._executor = self._executor, None
        self._closing.set()
        for ex in (executor, self._range_executor):
            if ex is None:
                continue
            ex.shutdown(wait=False, cancel_futures=True)
            try:
                await asyncio.wait_for(asyncio.to_thread(ex.shutdown, True),
                                       self.cfg.timeout_s + 1.0)
            except TimeoutError:
                log.warning("s3 calls still running at close; not waiting for them")
        self._range_executor = None
        self._client = None

    def _ensure_bucket_blocking(self) -> None:
        if self._bucket_ready:
            return
        try:
            self._client.head_bucket(Bucket=self.cfg.bucket)
        except ClientError as e:
            if _code(e) not in _MISSING:
                raise
            self._client.create_bucket(Bucket=self.cfg.bucket)
            log.info("created bucket %s", self.cfg.bucket)
        self._bucket_ready = True

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            raise TierUnavailable("s3 tier is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _call(self, fn: Any, *args: Any, attempts: int | None = None) -> Any:
        """Run ``fn`` on the executor with retries; ``TierUnavailable`` once they are used up."""
        n = attempts or self.cfg.max_attempts
        if self._degraded:
            now = time.monotonic()
            if now < self._next_probe:
                raise TierUnavailable(f"{self._degraded} (next probe in "
                                      f"{self._next_probe - now:.2f}s)")
            self._next_probe = now + self._probe_pause  # this call is the probe
            self._probe_pause = min(self.cfg.backoff_max_s, max(self._probe_pause * 2,
                                                                self.cfg.backoff_s))
            n = 1
        try:
            out = await self._run(
                _with_retries, fn, args, n, self.cfg.backoff_s, self.cfg.backoff_max_s,
                self._closing,
            )
        except (BotoCoreError, ClientError) as e:
            if not self._degraded:
                self._next_probe = time.monotonic() + self.cfg.backoff_s
                self._probe_pause = self.cfg.backoff_s
            self._degraded = f"s3 unreachable: {e}"
            raise TierUnavailable(self._degraded) from None
        if self._degraded:
            log.info("s3 reachable again")
        self._degraded = ""
        self._last_answer = time.monotonic()
        return out

    async def check_health(self) -> None:
        """A HEAD of the bucket when no call has had an answer for ``health_check_s``
        (while degraded: the circuit breaker's probe, when one is due)."""
        if time.monotonic() - self._last_answer < self.cfg.health_check_s or not self._executor:
            return
        try:
            await self._call(self._head_bucket_blocking)
        except TierUnavailable:
            pass  # (degraded now, with the reason: stats() says so)

    def _head_bucket_blocking(self) -> None:
        self._client.head_bucket(Bucket=self.cfg.bucket)

    def _obj(self, key: str) -> str:
        return self.cfg.prefix + key

    # ---------------------------------------------------------------- operations

    async def get(self, key: str) -> Blob | None:
        return await self._call(self._get_blocking, key)

    def _get_blocking(self, key: str) -> bytes | None:
        self._ensure_bucket_blocking()
        try:
            resp = self._client.get_object(Bucket=self.cfg.bucket, Key=self._obj(key))
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            raise
        return resp["Body"].read()

    def _get_range_blocking(self, obj: str, lo: int, hi: int) -> bytes:
        """Bytes ``lo .. hi - 1`` of the object named ``obj`` (in the bucket)."""
        resp = self._client.get_object(Bucket=self.cfg.bucket, Key=obj,
                                       Range=f"bytes={lo}-{hi - 1}")
        return resp["Body"].read()

    def _get_ranged_blocking(self, key: str) -> Stored | bytes | None:
        """The object's first range, its body a stream the check reads (``S3Stored``)."""
        assert self._ranges is not None
        self._ensure_bucket_blocking()
        obj = self._obj(key)
        try:
            resp = self._client.get_object(Bucket=self.cfg.bucket, Key=obj,
                                           Range=f"bytes=0-{self.range_bytes - 1}")
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            if _code(e) in ("InvalidRange", "416"):  # an empty object has no byte 0
                return self._get_blocking(key)
            raise
        sent = int(resp.get("ContentLength", 0))
        try:
            total = content_size(resp, sent)
            if sent != min(self.range_bytes, total):
                raise RangeFailed(key=key, why=f"first range: {sent} of {total} bytes")
        except RangeFailed:
            resp["Body"].close()
            raise
        return S3Stored(self._ranges, obj, total, resp["Body"], sent)

    async def get_many(self, keys: list[str]) -> list[Blob | None]:
        got = await self.get_many_checked(keys, whole_blob)
        return [None if g is None else g[1] for g in got]  # type: ignore[misc]

    async def get_many_checked(
        self, keys: list[str], check: Callable[[Stored], T]
    ) -> list[Checked[T]]:
        """Every key at once, each on its own thread of the executor (a layer's chunks are
        independent objects: one round trip of latency, not one per chunk), checked there
        (off the loop, bytes still in cache). Returns only once every call has ended, the
        checks included: a check may be writing into an engine's pool blocks."""

        read = self._get_ranged_blocking if self._ranges is not None else self._get_blocking

        def one(key: str) -> Checked[T]:
            found = read(key)
            try:
                return apply_check(found, check, key)
            finally:
                if isinstance(found, S3Stored):
                    found.release()  # (a check that stopped early leaves it unread)

        got = await asyncio.gather(*(self._call(one, k) for k in keys), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        return got  # type: ignore[return-value]

    async def put(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        def blocking() -> None:
            self._ensure_bucket_blocking()
            self._client.put_object(Bucket=self.cfg.bucket, Key=self._obj(key), Body=blob)

        await self._call(blocking)
        self.bytes_used += len(blob)
        return []

    async def contains(self, key: str) -> bool:
        return await self.written_at(key) is not None  # one HEAD either way

    async def delete(self, key: str) -> bool:
        def blocking() -> bool:
            self._ensure_bucket_blocking()
            self._client.delete_object(Bucket=self.cfg.bucket, Key=self._obj(key))
            return True

        return await self._call(blocking)

    async def written_at(self, key: str) -> float | None:
        def blocking() -> float | None:
            self._ensure_bucket_blocking()
            try:
                head = self._client.head_object(Bucket=self.cfg.bucket, Key=self._obj(key))
            except ClientError as e:
                if _code(e) in _MISSING:
                    return None
                raise
            return float(head["LastModified"].timestamp())

        return await self._call(blocking)

    async def refresh(self, key: str) -> bool:
        """Copy the object onto itself: S3 has no touch, and expiry counts from
        LastModified (a server-side copy; the bytes do not come here)."""
        def blocking() -> bool:
            self._ensure_bucket_blocking()
            obj = self._obj(key)
            try:
                self._client.copy_object(
                    Bucket=self.cfg.bucket, Key=obj, MetadataDirective="REPLACE",
                    CopySource={"Bucket": self.cfg.bucket, "Key": obj},
                )
            except ClientError as e:
                if _code(e) in _MISSING:
                    return False
                raise
            return True

        return await self._call(blocking)

    async def scan_expired(self, older_than: float) -> list[str]:
        def blocking() -> list[str]:
            self._ensure_bucket_blocking()
            out: list[str] = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.cfg.bucket, Prefix=self.cfg.prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    if obj["LastModified"].timestamp() < older_than:
                        out.append(obj["Key"][len(self.cfg.prefix) :])
            return out

        return await self._call(blocking)

    def stats(self) -> TierStats:
        return TierStats(self.name, 0, self.bytes_used, 0, not self._degraded, self._degraded)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _retryable(e: Exception) -> bool:
    if isinstance(e, ClientError):
        return _code(e) in _RETRYABLE_CODES
    return isinstance(e, BotoCoreError)  # connection refused/reset, timeouts


def _with_retries(fn: Any, args: tuple, attempts: int, backoff: float, backoff_max: float,
                  stop: threading.Event) -> Any:
    """Call ``fn`` up to ``attempts`` times, waiting (on this worker thread) between tries;
    ``stop`` (the tier closing) ends the retries: the last error is raised."""
    pause = backoff
    for i in range(attempts):
        try:
            return fn(*args)
        except (BotoCoreError, ClientError) as e:
            if i == attempts - 1 or not _retryable(e):
                raise
            log.debug("s3 call failed (%s), retry %d in %.3fs", e, i + 1, pause)
            if stop.wait(pause):
                raise
            pause = min(backoff_max, pause * 2 if pause else backoff_max)
    raise AssertionError("unreachable: the loop returns or raises")
