"""KV store configuration (section ``kvstore:``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt, sub
from shared.s3_config import S3Config


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = opt("127.0.0.1", "address the KVStore gRPC server binds to")
    port: int = opt(50054, "KVStore gRPC port (0 = pick a free port)", min=0, max=65535)
    node_id: str = opt("node-0", "id of the node this store belongs to")
    tiers: list[str] = opt(
        ["dram", "ssd", "s3"],
        "tiers fastest first (dram first); "
        "ssd is off when ssd_path is empty, s3 when s3.bucket is empty",
    )
    dram_bytes: int = opt(2 << 30, "DRAM arena budget in bytes", min=0)
    ssd_path: str = opt(
        "", "SSD tier directory (RocksDB catalog + one file per chunk); empty disables it"
    )
    cpus: str = opt(
        "", "cores this kvstore runs on, e.g. '0-3' (CPU affinity); empty = all; "
        "`overture up` gives it its node's share"
    )
    ssd_bytes: int = opt(20 << 30, "SSD tier capacity in bytes", min=0)
    chunk_tokens: int = opt(256, "tokens per chunk (multiple of the block size)", min=1)
    ttl_s: float = opt(
        7 * 24 * 3600.0,
        "lowest-tier expiry in seconds, counted from an object's last write; a manifest "
        "refreshes the chunks it names once they are past half of it",
        min=1.0,
    )
    ssd_cache_bytes: int = opt(256 << 20, "RocksDB block cache in bytes", min=1 << 20)
    ssd_sync: bool = opt(
        False, "fsync each SSD write (chunk file, its directory, the RocksDB WAL): power-loss safe"
    )
    ssd_inline_bytes: int = opt(
        4096, "SSD values up to this size stay inside RocksDB; larger ones (chunks) get a file",
        min=0,
    )
    local_ttl_s: float = opt(24 * 3600.0, "DRAM/SSD entries idle this long are swept", min=1.0)
    sweep_interval_s: float = opt(30.0, "seconds between sweeps of expired entries", min=0.01)
    retention_sessions: int = opt(
        100_000, "sessions saved with a prompt_cache_retention whose expiry is kept in "
        "memory; past it the oldest falls back to the tiers' TTLs", min=1)
    write_queue: int = opt(
        1024,
        "write-behind queue bound; beyond it the lowest-priority "
        "oldest work is dropped (local copies are kept)",
        min=1,
    )
    write_workers: int = opt(4, "concurrent write-behind workers", min=1, max=64)
    retry_backoff_max_s: float = opt(
        5.0, "longest pause before re-trying a failed write-behind", min=0.001, max=300.0
    )
    stream_window: int = opt(4, "chunks read ahead of the consumer in GetChunks", min=1, max=256)
    peer_address: str = opt("", "default peer kvstore (host:port) for PullSession")
    peer_timeout_s: float = opt(
        10.0, "PullSession: deadline of the peer's manifest, and the longest wait for its "
        "next chunk", min=0.01, max=600.0,
    )
    peer_wait_s: float = opt(
        2.0, "FindPrefix: longest wait for the asked session's save still in flight here "
        "(a next turn on another node never sees half of the previous one)", min=0.0,
        max=60.0,
    )
    prefetch_join_s: float = opt(
        1.0, "a lookup of a session still being staged here for an advisory waits "
        "this long at most (and at most half its deadline) for it to land", min=0.0,
        max=30.0,
    )
    peer_data_port: int = opt(
        0, "TCP port peers stream chunk bytes from (0 = a free port)", min=0, max=65535,
    )
    peer_bytes_per_s: float = opt(
        3e8, "assumed bandwidth of a peer link until a pull from it has been measured", min=1.0
    )
    debug_save_delay_s: float = opt(
        0.0, "fault injection for tests: hold every SaveFromPool this long before it starts "
        "(a save still in flight when the next turn arrives elsewhere); 0 = off", min=0.0,
        max=60.0,
    )
    debug_chunk_delay_s: float = opt(
        0.0, "fault injection for tests: pause this long before each chunk GetChunks sends "
        "by key (a slow peer pull); 0 = off", min=0.0, max=60.0,
    )
    drain_s: float = opt(5.0, "on shutdown, wait this long for queued writes", min=0.0, max=600.0)
    metrics_port: int = opt(0, "aiohttp /metrics port (0 = off)", min=0, max=65535)
    lease_s: float = opt(
        30.0, "a LookupPrefix lease expires this long after it was granted", min=0.01, max=3600.0
    )
    # 1: on a CPU pool a load's reads and copies run on the cores the forward pass it
    # overlaps uses; one layer at a time keeps them to one core (two in flight made a 2k
    # SSD resume ~12 ms slower). Storage that waits on I/O (a cold NVMe) wants more.
    load_readahead_layers: int = opt(
        1, "LoadIntoPool reads up to this many layers ahead of the copy", min=1, max=64
    )
    # S3 waits on round trips, not on these cores: its layers are read further ahead, and
    # an object by ranges in parallel (tiers/s3_ranges.py).
    # Both off by default: on a loaded 2-core host the ranged reads measured slower than one
    # GET an object (bench/README.md); a quiet rerun decides.
    load_readahead_remote_layers: int = opt(
        1, "LoadIntoPool reads up to this many layers ahead when the lease holds its chunks "
        "in no local tier (they come from S3)", min=1, max=64
    )
    s3_range_bytes: int = opt(
        0, "a load reads an S3 object by ranged GETs of this many bytes, in parallel "
        "(0 = one GET per object)", min=0
    )
    s3: S3Config = sub(S3Config, "durable S3 tier")
