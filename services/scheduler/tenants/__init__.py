"""Who may call and how much: API keys and admin keys kept as digests (``keys.py``), and
each tenant's request and advisory rates and generations in flight (``limits.py``)."""

from services.scheduler.tenants.keys import KeyBook, key_book
from services.scheduler.tenants.limits import TenantLimits, TokenBuckets

__all__ = ["KeyBook", "TenantLimits", "TokenBuckets", "key_book"]
