"""Advisories (Symphony §3.3, §3.6): a request announced before it is sent. The book of
pending ones (``book.py``), where each goes and what it counts for (``placement.py``), the
throttle of tenants that advise uselessly (``throttle.py``), and the advisor that ties
them to the nodes' prefetches and the metrics (``advisor.py``)."""

from services.scheduler.advisory.advisor import AdviceAsked, Advisor
from services.scheduler.advisory.book import (
    CLIENT,
    EXPIRED,
    FOLLOWED,
    INFERRED,
    INVALIDATED,
    LATE,
    REPLACED,
    Advisory,
    AdvisoryBook,
    TooManyAdvisories,
)
from services.scheduler.advisory.inferred import Expected, ToolLatencies
from services.scheduler.advisory.placement import AdvisoryPlacement, Placed
from services.scheduler.advisory.throttle import AdvisoryThrottle

__all__ = [
    "CLIENT", "EXPIRED", "FOLLOWED", "INFERRED", "INVALIDATED", "LATE", "REPLACED",
    "AdviceAsked", "Advisor", "Advisory", "AdvisoryBook", "AdvisoryPlacement",
    "AdvisoryThrottle", "Expected", "Placed", "TooManyAdvisories", "ToolLatencies",
]
