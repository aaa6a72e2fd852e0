"""What a policy is asked and what it answers, as plain data.

A ``RouteRequest`` says what is known of a request (or an advisory) when it is placed:
its model, session, tenant, priority, the node holding the session's KV and the node an
advisory chose. The policy answers with a plan that the callers carry out as it says:

- ``RoutePlan`` for a generation: the node, whether it may reuse KV at all (or only what
  is in its device memory), and the node whose kvstore to pull the session's KV from
  (the dispatcher names that kvstore in the request when the holder is alive:
  ``kv_source.py``);
- ``AdvisoryPlan`` for an advisory: the node, whether it prefetches the session's KV (and
  from which node), and whether straight into device memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.scheduler.cluster import Node


@dataclass(frozen=True)
class RouteRequest:
    model: str
    session_id: str = ""
    tenant: str = "default"
    priority: int = 0
    holder: str = ""  # the node holding the session's KV (its last turn's), if known
    holder_tokens: int = 0  # the KV the holder has: its last turn's prompt + completion
    advised: str = ""  # the node an advisory chose for this request (its KV goes there)
    # An advisory's: per node, the load counted now that will be gone when it arrives.
    gone: Mapping[str, int] = field(default_factory=dict)
    prefix: tuple[str, ...] = ()  # the chat's leading context (cluster/prefixes.py)
    prefix_nodes: tuple[str, ...] = ()  # the nodes holding that context, best first
    # (node, leading prompt blocks its device holds) for the nodes holding any (the
    # ``prefix`` policy's index, ``cluster/prefixes.py``; empty for the other policies)
    prefix_hits: tuple[tuple[str, int], ...] = ()
    # ``time.monotonic()`` the request arrived in the scheduler (0.0: unknown): the engine's
    # queue limit counts from then (``waited_ms`` on the node's request).
    arrived: float = 0.0


@dataclass(frozen=True)
class RoutePlan:
    """Where one generation runs and what it does with the session's KV."""

    node: Node
    reuse_kv: bool  # False: the node reuses no KV at all, not even its device prefix cache
    pull_from: str = ""  # the node whose kvstore holds the KV ("": the node's own tiers, S3)
    device_only: bool = False  # reuse only the device prefix cache; no kvstore tier at all


@dataclass(frozen=True)
class AdvisoryPlan:
    """Where an advised session's next request will run and what that node does now."""

    node: Node
    prefetch: bool  # the node moves the KV into place (False: the advisory is only recorded)
    straight_to_device: bool = False  # the prefetch may evict the device cache to fit
    pull_from: str = ""  # the node whose kvstore holds the KV ("": the node's own tiers, S3)

