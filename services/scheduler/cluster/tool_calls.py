"""The session of a tool call: how an agent that names no session still has one.

Agent frameworks resend the whole conversation every turn and name no session (the
Agents SDK without ``previous_response_id``, LangGraph over ``ChatOpenAI``). Their turns
are still one conversation, and a tool call ties them: the call id a turn returns comes
back in the next turn's history, with the tool's result. So a turn offering tools gets a
session of its own when it names none, the ids of the calls it makes are recorded here
against that session, and the next request whose history carries one of those ids is the
same session: its inferred advisory is followed and its KV found where it was left.
Per tenant (a call id names nothing across tenants); bounded, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ToolCallSessions:
    """Event-loop only."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def record(self, tenant: str, call_ids: Iterable[str], session_id: str) -> None:
        """The calls ``call_ids`` were made by a turn of ``session_id``."""
        if not session_id:
            return
        for call_id in call_ids:
            if call_id:
                self._sessions.pop((tenant, call_id), None)
                self._sessions[(tenant, call_id)] = session_id
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def session_of(self, tenant: str, call_ids: Iterable[str]) -> str:
        """The session of the latest known call among ``call_ids`` ("": none known)."""
        for call_id in reversed(list(call_ids)):
            session = self._sessions.get((tenant, call_id))
            if session is not None:
                self._sessions.move_to_end((tenant, call_id))
                return session
        return ""
