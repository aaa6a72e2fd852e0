"""Typed kvstore errors. Callers turn every ``StorageError`` into a miss or a recompute."""

from __future__ import annotations

from shared.chunk_codec import ChunkCorrupt, StorageError

__all__ = [
    "ChunkCorrupt",
    "ManifestIncomplete",
    "StorageError",
    "TierOpenError",
    "TierUnavailable",
    "WriteDropped",
    "WriteRefused",
]


class TierUnavailable(StorageError):
    """A tier could not be reached (S3 down, RocksDB closed); transient, retry later."""


class TierOpenError(StorageError):
    """A tier could not start (RocksDB path locked or not writable, disk full).

    A configuration-time failure: the message names the config key and the fix.
    """


class WriteDropped(StorageError):
    """A queued write-behind was dropped because the queue was full (the local copy stays)."""


class WriteRefused(StorageError):
    """A tier will never take this blob (larger than its whole capacity): not retried."""


class ManifestIncomplete(StorageError):
    """A manifest names a chunk that is not durable in the lowest tier, so it is not written."""


class PeerFetchFailed(Exception):
    """A layer of a session could not be had from the peer that holds it (unreachable,
    stalled, or a chunk that fails its checks): that layer and later ones recompute."""
