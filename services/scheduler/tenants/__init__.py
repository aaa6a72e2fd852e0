"""Who may call and how much: API keys and admin keys kept as digests (``keys.py``), and
each tenant's request and advisory rates and generations in flight (``limits.py``), and
its refused requests admitted in their turn (``turns.py``)."""

from services.scheduler.tenants.keys import KeyBook, key_book
from services.scheduler.tenants.limits import TenantLimits, TokenBuckets
from services.scheduler.tenants.turns import TOKEN_HEADER, Turns

__all__ = ["TOKEN_HEADER", "KeyBook", "TenantLimits", "TokenBuckets", "Turns", "key_book"]
