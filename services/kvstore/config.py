"""KV store configuration (section ``kvstore:``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt, sub


@dataclass(frozen=True)
class S3Config:
    endpoint_url: str = opt("", "S3 endpoint (empty = AWS default; MinIO or moto URL otherwise)")
    bucket: str = opt("", "bucket for the durable tier; empty disables S3")
    prefix: str = opt("overture/", "key prefix inside the bucket")
    region: str = opt("us-east-1", "S3 region")
    access_key_id: str = opt("", "access key (empty = boto3's default credential chain)")
    secret_access_key: str = opt("", "secret key")


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = opt("127.0.0.1", "address the KVStore gRPC server binds to")
    port: int = opt(50054, "KVStore gRPC port (0 = pick a free port)", min=0, max=65535)
    node_id: str = opt("node-0", "id of the node this store belongs to")
    dram_bytes: int = opt(2 << 30, "DRAM arena budget in bytes", min=0)
    ssd_path: str = opt("", "RocksDB directory; empty disables the SSD tier")
    ssd_bytes: int = opt(20 << 30, "SSD tier capacity in bytes", min=0)
    chunk_tokens: int = opt(256, "tokens per chunk (multiple of the block size)", min=1)
    ttl_s: float = opt(7 * 24 * 3600.0, "lowest-tier expiry in seconds", min=1.0)
    s3: S3Config = sub(S3Config, "durable S3 tier")
