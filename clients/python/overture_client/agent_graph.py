"""Agent call graphs (Symphony §3.5): advise the agents likely to run next.

An agent workflow calls its agents in an order that repeats from run to run (a product
manager, then an architect, then an engineer and a reviewer in turns). ``AgentGraph``
learns it from a profiling run: which agent follows which, and how long each one runs
before the next starts. In later runs, when an agent starts, it advises every likely
successor at once, each expected when the current agent usually ends, so their KV is in
place when they are called; when the next agent starts, the advisories of the branches
not taken are invalidated (§3.6). It keeps learning as it goes.

Each agent has its own session (its own conversation and KV): ``session_of(agent)``.
Works with ``Overture`` (``agent_sync`` / ``start_sync``) and ``AsyncOverture``
(``agent`` / ``start``).
"""

from __future__ import annotations

import inspect
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from overture_client.client import Advisory, AsyncOverture, Overture

END = "__end__"


class AgentGraph:
    def __init__(self, client: Overture | AsyncOverture, session_of: Callable[[str], str],
                 model: str | None = None, min_share: float = 0.2, max_successors: int = 4,
                 advising: bool = False) -> None:
        self.client, self.session_of, self.model = client, session_of, model
        self.min_share, self.max_successors = min_share, max_successors
        self.advising = advising  # False: a profiling run (learn only)
        self.transitions: dict[str, Counter[str]] = defaultdict(Counter)
        self.durations: dict[str, list[float]] = defaultdict(list)
        self._current: tuple[str, float] | None = None
        self._pending: dict[str, Advisory] = {}  # agent -> its advisory

    # ------------------------------------------------------------ what was learnt
    def successors(self, agent: str) -> list[tuple[str, float]]:
        """Likely next agents with their share of the observed transitions."""
        seen = self.transitions.get(agent)
        if not seen:
            return []
        total = sum(seen.values())
        likely = [(nxt, n / total) for nxt, n in seen.most_common()
                  if nxt != END and n / total >= self.min_share]
        return likely[: self.max_successors]

    def expected_duration(self, agent: str) -> float:
        d = self.durations.get(agent) or []
        recent = d[-20:]
        return sum(recent) / len(recent) if recent else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"transitions": {a: dict(c) for a, c in self.transitions.items()},
                "durations": {a: d[-20:] for a, d in self.durations.items()}}

    def load(self, data: dict[str, Any]) -> AgentGraph:
        for a, c in data.get("transitions", {}).items():
            self.transitions[a].update(c)
        for a, d in data.get("durations", {}).items():
            self.durations[a].extend(float(x) for x in d)
        return self

    # ------------------------------------------------------------ a run
    def _step(self, agent: str) -> tuple[list[Advisory], list[tuple[str, float]]]:
        """Learn the transition into ``agent``; (advisories to invalidate, successors to
        advise with their expected arrival)."""
        now = time.monotonic()
        if self._current is not None:
            prev, started = self._current
            self.transitions[prev][agent] += 1
            if agent != END:
                self.durations[prev].append(now - started)
        nexts = ([] if not self.advising or agent == END else
                 [(n, self.expected_duration(agent)) for n, _ in self.successors(agent)])
        # Advisories still pending for agents that may come next stay; the rest end.
        keep = {agent} | {n for n, _ in nexts}
        stale = [adv for name, adv in self._pending.items() if name not in keep]
        self._pending = {n: a for n, a in self._pending.items() if n in keep and n != agent}
        self._current = (agent, now) if agent != END else None
        return stale, [(n, lead) for n, lead in nexts if n not in self._pending]

    def _advise_body(self, nexts: list[tuple[str, float]]) -> tuple[str, float, list[dict]]:
        first, lead = nexts[0]
        more = [{"session_id": self.session_of(n), "expected_arrival_s": arrive}
                for n, arrive in nexts[1:]]
        return self.session_of(first), lead, more

    def _remember(self, nexts: list[tuple[str, float]], adv: Advisory) -> None:
        self._pending[nexts[0][0]] = adv
        for (name, _), succ in zip(nexts[1:], adv.successors, strict=False):
            self._pending[name] = succ

    async def start(self, agent: str) -> None:
        """``agent`` starts now (``END``: the run is over)."""
        stale, nexts = self._step(agent)
        for adv in stale:
            await _maybe_await(self.client.invalidate(adv.advisory_id, adv.session_id))
        if nexts:
            session, lead, more = self._advise_body(nexts)
            adv = await _maybe_await(self.client.advise(session, self.model, lead,
                                                        successors=more))
            self._remember(nexts, adv)

    def start_sync(self, agent: str) -> None:
        assert isinstance(self.client, Overture), "start_sync needs the blocking client"
        stale, nexts = self._step(agent)
        for adv in stale:
            self.client.invalidate(adv.advisory_id, adv.session_id)
        if nexts:
            session, lead, more = self._advise_body(nexts)
            self._remember(nexts, self.client.advise(session, self.model, lead,
                                                     successors=more))

    @asynccontextmanager
    async def agent(self, name: str) -> AsyncIterator[str]:
        """``async with graph.agent("engineer") as session_id:`` around the agent's call."""
        await self.start(name)
        yield self.session_of(name)

    @contextmanager
    def agent_sync(self, name: str) -> Iterator[str]:
        self.start_sync(name)
        yield self.session_of(name)

    async def finish(self) -> None:
        await self.start(END)

    def finish_sync(self) -> None:
        self.start_sync(END)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
