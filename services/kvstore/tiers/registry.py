"""Tiers by name. ``kvstore.tiers`` lists them fastest first; unknown names fail loudly."""

from __future__ import annotations

from collections.abc import Callable

from services.kvstore.config import KVStoreConfig
from services.kvstore.tiers.base import Tier
from services.kvstore.tiers.dram import DramTier
from services.kvstore.tiers.s3 import S3Tier
from services.kvstore.tiers.ssd import SsdTier
from shared.config import ConfigError

# A factory returns None when its tier is switched off by configuration.
TierFactory = Callable[[KVStoreConfig], Tier | None]


def _dram(cfg: KVStoreConfig) -> Tier | None:
    return DramTier(cfg.dram_bytes)


def _ssd(cfg: KVStoreConfig) -> Tier | None:
    if not cfg.ssd_path:
        return None
    return SsdTier(cfg.ssd_path, cfg.ssd_bytes, cfg.ssd_sync, cache_bytes=cfg.ssd_cache_bytes,
                   inline_max_bytes=cfg.ssd_inline_bytes)


def _s3(cfg: KVStoreConfig) -> Tier | None:
    return S3Tier(cfg.s3, cfg.s3_range_bytes) if cfg.s3.bucket else None


TIER_FACTORIES: dict[str, TierFactory] = {"dram": _dram, "ssd": _ssd, "s3": _s3}


def build_tiers(cfg: KVStoreConfig) -> list[Tier]:
    """The enabled tiers in ``cfg.tiers`` order (fastest first); DRAM must come first."""
    tiers: list[Tier] = []
    for name in cfg.tiers:
        factory = TIER_FACTORIES.get(name)
        if factory is None:
            raise ConfigError(
                f"kvstore.tiers: unknown tier {name!r}; "
                f"known tiers: {', '.join(sorted(TIER_FACTORIES))}"
            )
        tier = factory(cfg)
        if tier is not None:
            tiers.append(tier)
    if not tiers or not isinstance(tiers[0], DramTier):
        raise ConfigError("kvstore.tiers: the first tier must be 'dram' (puts land there first)")
    return tiers
