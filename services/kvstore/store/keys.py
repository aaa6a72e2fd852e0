"""How chunks and manifests are named inside the tiers: one key space, two prefixes."""

from __future__ import annotations

CHUNK_PREFIX = "c/"
MANIFEST_PREFIX = "m/"


def chunk_tier_key(key: str) -> str:
    """The key under which the tiers hold chunk ``key`` (what a read's ``Stored.key`` says)."""
    return CHUNK_PREFIX + key


def manifest_tier_key(key: str) -> str:
    """The key under which the tiers hold the manifest ``key`` (``manifest_key(...)``)."""
    return MANIFEST_PREFIX + key


def chunk_of(tier_key: str) -> str | None:
    """The chunk key inside ``tier_key``, or None when it names something else."""
    return tier_key[len(CHUNK_PREFIX):] if tier_key.startswith(CHUNK_PREFIX) else None
