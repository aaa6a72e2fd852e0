"""Storage tiers of the kvstore behind one interface (``Tier``), built by name."""

from __future__ import annotations

from services.kvstore.tiers.base import Blob, Tier, TierStats
from services.kvstore.tiers.dram import DramTier
from services.kvstore.tiers.registry import TIER_FACTORIES, build_tiers
from services.kvstore.tiers.s3 import S3Tier
from services.kvstore.tiers.ssd import SsdTier

__all__ = [
    "TIER_FACTORIES",
    "Blob",
    "DramTier",
    "S3Tier",
    "SsdTier",
    "Tier",
    "TierStats",
    "build_tiers",
]
