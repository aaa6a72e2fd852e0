"""The S3 bucket of the cluster's durable tier (``kvstore.s3``), shared by the kvstores
(the KV chunks and manifests) and the scheduler (stored responses, ``scheduler.s3``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass(frozen=True)
class S3Config:
    endpoint_url: str = opt(
        "", "S3 endpoint (empty = AWS default; else SeaweedFS, MinIO or any S3 URL)"
    )
    bucket: str = opt("", "bucket for the durable tier; empty disables S3")
    prefix: str = opt("overture/", "key prefix inside the bucket")
    region: str = opt("us-east-1", "S3 region")
    access_key_id: str = opt("", "access key (empty = boto3's default credential chain)")
    secret_access_key: str = opt("", "secret key")
    credentials: str = opt(
        "keys", "where the key pair comes from: 'keys' (access_key_id/secret_access_key, or "
        "boto3's default chain when empty) or 'cluster' (derived from the cluster secret: "
        "the S3 server `overture up`, compose and the k8s manifests start)",
        choices=("keys", "cluster"),
    )
    max_attempts: int = opt(4, "attempts per S3 call before it counts as failed", min=1, max=20)
    backoff_s: float = opt(0.05, "first retry pause; doubles per attempt", min=0.0, max=10.0)
    backoff_max_s: float = opt(2.0, "longest pause between retries", min=0.0, max=60.0)
    timeout_s: float = opt(5.0, "connect and read timeout of one S3 request", min=0.05, max=300.0)
    threads: int = opt(8, "threads running blocking boto3 calls", min=1, max=64)
    health_check_s: float = opt(
        5.0, "how long the tier may go without an answer from the endpoint before it asks "
        "(a HEAD of the bucket): an outage while idle shows in the node's health",
        min=0.1, max=3600.0,
    )
