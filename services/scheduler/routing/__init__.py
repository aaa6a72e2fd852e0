"""Where a generation goes and how it gets there: the policies (``policy.py``), the
dispatcher that streams one generation from a node, re-routing while nothing came
(``dispatch.py``), and the fan-out of a request's choices (``fanout.py``)."""

from services.scheduler.routing.dispatch import (
    Advisories,
    Dispatcher,
    DispatchSettings,
    NodeStalled,
)
from services.scheduler.routing.fanout import run_choices
from services.scheduler.routing.policy import POLICIES, Policy, RouteRequest, make_policy

__all__ = [
    "POLICIES", "Advisories", "DispatchSettings", "Dispatcher", "NodeStalled", "Policy",
    "RouteRequest", "make_policy", "run_choices",
]
