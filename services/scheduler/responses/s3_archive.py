"""Stored responses in the cluster's shared S3 bucket, under the tenant:
``<prefix><tenant>/responses/<response id>.json`` beside the tenant's KV objects.

Every scheduler replica (and the next scheduler process after a restart) reads the same
bucket, so a chain continues wherever the request lands. Records past their time are
deleted when read, and by a periodic sweep that reads at most ``sweep_max`` of them each
time, resuming where the last one stopped. The bucket, endpoint and
credentials are the kvstores' (``scheduler.s3`` takes the same keys as ``kvstore.s3``);
how the credentials are found is ``s3_client_kwargs`` alone, the one place to change
when they come from somewhere else (e.g. derived from the cluster secret).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from services.scheduler.responses.archive import ArchiveUnavailable, ExpiredCheck
from shared.s3_config import S3Config
from shared.s3_credentials import boto_keys

_MISSING = {"NoSuchKey", "404", "NotFound"}


def s3_client_kwargs(cfg: S3Config) -> dict[str, Any]:
    """boto3 client arguments for ``cfg``: endpoint, region, timeouts and credentials
    (none given: boto3's default chain, e.g. a pod's role)."""
    kwargs: dict[str, Any] = {
        "region_name": cfg.region,
        "config": BotoConfig(retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
                             connect_timeout=cfg.timeout_s, read_timeout=cfg.timeout_s),
    }
    if cfg.endpoint_url:
        kwargs["endpoint_url"] = cfg.endpoint_url
    return {**kwargs, **boto_keys(cfg)}


class S3Archive:
    """Blocking boto3 calls (the store runs them in threads). The client is made on first
    use: creating one loads botocore's service models, too slow for a constructor."""

    def __init__(self, cfg: S3Config, client: Any = None, sweep_max: int = 1000) -> None:
        self.cfg = cfg
        self._client = client
        self.sweep_max = sweep_max  # records a sweep reads at most
        # Where the last sweep stopped: (the tenant's folder, the last record looked at).
        self._cursor = ("", "")

    def _s3(self) -> Any:
        if self._client is None:
            self._client = boto3.session.Session().client("s3", **s3_client_kwargs(self.cfg))
        return self._client

    def key(self, tenant: str, response_id: str) -> str:
        return f"{self.cfg.prefix}{quote(tenant, safe='')}/responses/{response_id}.json"

    def save(self, tenant: str, response_id: str, record: bytes) -> None:
        try:
            self._s3().put_object(Bucket=self.cfg.bucket, Key=self.key(tenant, response_id),
                                  Body=record)
        except (BotoCoreError, ClientError) as e:
            raise ArchiveUnavailable(f"S3 put of a stored response: {e}") from None

    def load(self, tenant: str, response_id: str) -> bytes | None:
        try:
            obj = self._s3().get_object(Bucket=self.cfg.bucket,
                                        Key=self.key(tenant, response_id))
            body: bytes = obj["Body"].read()
            return body
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _MISSING:
                return None
            raise ArchiveUnavailable(f"S3 get of a stored response: {e}") from None
        except BotoCoreError as e:
            raise ArchiveUnavailable(f"S3 get of a stored response: {e}") from None

    def delete(self, tenant: str, response_id: str) -> None:
        try:
            self._s3().delete_object(Bucket=self.cfg.bucket, Key=self.key(tenant, response_id))
        except (BotoCoreError, ClientError) as e:
            raise ArchiveUnavailable(f"S3 delete of a stored response: {e}") from None

    def sweep(self, expired: ExpiredCheck) -> int:
        """Delete the records ``expired`` says are past their time among the next
        ``sweep_max`` (bounded work however many the bucket holds): tenant by tenant, only
        their ``responses/`` folders (never the KV objects beside them), from where the
        last sweep stopped, back to the first tenant after the last. Raises
        ArchiveUnavailable."""
        try:
            return self._sweep(expired)
        except (BotoCoreError, ClientError) as e:
            raise ArchiveUnavailable(f"S3 sweep of stored responses: {e}") from None

    def _sweep(self, expired: ExpiredCheck) -> int:
        s3, bucket = self._s3(), self.cfg.bucket
        gone = read = 0
        tenant, after = self._cursor
        for folder in self._tenants(tenant):
            start = after if folder == tenant else ""
            while read < self.sweep_max:
                page = s3.list_objects_v2(
                    Bucket=bucket, Prefix=f"{folder}responses/", StartAfter=start,
                    MaxKeys=min(1000, self.sweep_max - read))
                for obj in page.get("Contents", []):
                    start = obj["Key"]
                    read += 1
                    body = self._get(start)
                    if body is not None and expired(body):
                        s3.delete_object(Bucket=bucket, Key=start)
                        gone += 1
                if not page.get("IsTruncated"):
                    start = ""
                    break
            self._cursor = (folder, start) if start else (folder + "\uffff", "")
            if read >= self.sweep_max:
                return gone
        self._cursor = ("", "")  # every tenant looked at: the next sweep starts over
        return gone

    def _tenants(self, after: str) -> list[str]:
        """The tenants' folders (``<prefix><tenant>/``) from ``after`` on, in key order."""
        s3, token = self._s3(), None
        out: list[str] = []
        while True:
            page = s3.list_objects_v2(Bucket=self.cfg.bucket, Prefix=self.cfg.prefix,
                                      Delimiter="/",
                                      **({"ContinuationToken": token} if token else {}))
            out.extend(p["Prefix"] for p in page.get("CommonPrefixes", [])
                       if p["Prefix"] >= after)
            token = page.get("NextContinuationToken")
            if not token:
                return out

    def _get(self, key: str) -> bytes | None:
        try:
            body: bytes = self._s3().get_object(Bucket=self.cfg.bucket, Key=key)["Body"].read()
            return body
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _MISSING:
                return None  # (deleted meanwhile)
            raise
