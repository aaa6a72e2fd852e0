"""Stored responses in the cluster's shared S3 bucket, under the tenant:
``<prefix><tenant>/responses/<response id>.json`` beside the tenant's KV objects.

Every scheduler replica (and the next scheduler process after a restart) reads the same
bucket, so a chain continues wherever the request lands. The bucket, endpoint and
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

    def __init__(self, cfg: S3Config, client: Any = None) -> None:
        self.cfg = cfg
        self._client = client

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
        """Nothing: an expired record is deleted when read, and the bucket's own expiry
        (the kvstores' TTL, or a lifecycle rule) removes the rest."""
        return 0
