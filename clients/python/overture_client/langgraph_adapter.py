"""LangGraph: advise a node's successors when the node starts, from the graph's own edges
(``pip install overture-client[langgraph]``).

    advisor = LangGraphAdvisor(client, app, session_of=lambda node: f"{run}-{node}")
    app.invoke(state, config={"callbacks": [advisor]})

Each node is an agent with its session (``session_of(node)``). When a node starts, every
node an edge leads to from it (conditional edges included: the graph does not know yet
which branch it will take) is advised, expected when the node usually ends (learnt as
the graph runs; ``default_lead_s`` until then); when the next node starts, the branches
not taken are invalidated, and so is everything pending when the graph ends.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from overture_client.client import Advisory, Overture

SPECIAL = ("__start__", "__end__")


def graph_successors(app: Any) -> dict[str, list[str]]:
    """node -> the nodes its edges lead to, from a compiled graph."""
    out: dict[str, list[str]] = defaultdict(list)
    for edge in app.get_graph().edges:
        if (edge.source not in SPECIAL and edge.target not in SPECIAL
                and edge.target not in out[edge.source]):
            out[edge.source].append(edge.target)
    return dict(out)


class LangGraphAdvisor(BaseCallbackHandler):
    def __init__(self, client: Overture, app: Any, session_of: Callable[[str], str],
                 model: str | None = None, default_lead_s: float = 1.0) -> None:
        self.client, self.session_of, self.model = client, session_of, model
        self.default_lead_s = default_lead_s
        self.successors = graph_successors(app)
        self.durations: dict[str, float] = {}
        self._seen: set[tuple[Any, str]] = set()  # (step, node) already handled
        self._current: tuple[str, float] | None = None
        self._pending: dict[str, Advisory] = {}
        self._root: UUID | None = None

    def on_chain_start(self, serialized: dict[str, Any] | None, inputs: Any, *,
                       run_id: UUID, parent_run_id: UUID | None = None,
                       metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if parent_run_id is None:
            self._root = run_id
        node = (metadata or {}).get("langgraph_node")
        step = (metadata or {}).get("langgraph_step")
        if not node or node in SPECIAL or (step, node) in self._seen:
            return  # (a runnable inside a node: its node was handled already)
        self._seen.add((step, node))
        self._node_started(node)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        if run_id == self._root:
            self._invalidate(keep=set())
            self._current, self._root = None, None
            self._seen.clear()

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.on_chain_end(None, run_id=run_id)

    def _node_started(self, node: str) -> None:
        now = time.monotonic()
        if self._current is not None:
            prev, started = self._current
            self.durations[prev] = now - started
        self._current = (node, now)
        # Pending advisories of nodes this one may lead to stay; the rest end.
        self._invalidate(keep={node, *self.successors.get(node, [])})
        self._pending.pop(node, None)  # (its own: followed by its request)
        nexts = [n for n in self.successors.get(node, []) if n not in self._pending]
        if not nexts:
            return
        lead = self.durations.get(node, self.default_lead_s)
        more = [{"session_id": self.session_of(n), "expected_arrival_s": lead}
                for n in nexts[1:]]
        adv = self.client.advise(self.session_of(nexts[0]), self.model, lead, successors=more)
        self._pending[nexts[0]] = adv
        for name, succ in zip(nexts[1:], adv.successors, strict=False):
            self._pending[name] = succ

    def _invalidate(self, keep: set[str]) -> None:
        for name, adv in list(self._pending.items()):
            if name not in keep:
                self.client.invalidate(adv.advisory_id, adv.session_id)
                del self._pending[name]
