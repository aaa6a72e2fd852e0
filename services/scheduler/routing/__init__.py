"""Where a generation goes and how it gets there: the policies (``policy.py``) and the plans
they return (``plan.py``), the dispatcher that streams one generation from a node,
re-routing while nothing came (``dispatch.py``), the request as the plan's node gets it
(``kv_source.py``), the fan-out of a request's choices (``fanout.py``), and each
node's admission window, sized from its measured capacity (``window.py``). (Which nodes
hold which prompt prefixes is a fact about the cluster: ``cluster/prefixes.py``.)"""

from services.scheduler.routing.dispatch import (
    Advisories,
    Dispatcher,
    DispatchSettings,
    NodeStalled,
)
from services.scheduler.routing.fanout import run_choices
from services.scheduler.routing.kv_source import node_request
from services.scheduler.routing.plan import AdvisoryPlan, RoutePlan, RouteRequest
from services.scheduler.routing.policy import POLICIES, Policy, make_policy
from services.scheduler.routing.window import NodeWindows, WindowSettings

__all__ = [
    "POLICIES",
    "Advisories",
    "AdvisoryPlan",
    "DispatchSettings",
    "Dispatcher",
    "NodeStalled",
    "NodeWindows",
    "Policy",
    "RoutePlan",
    "RouteRequest",
    "WindowSettings",
    "make_policy",
    "node_request",
    "run_choices",
]
