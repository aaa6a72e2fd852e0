"""Which nodes hold a prompt's leading context: shared system prompts as locality.

The sessions of an agent team (or of one product's users) start with the same system
prompt and tool definitions. A node that served one of them holds that prefix's KV (its
device cache, its kvstore's tiers); a *new* session with the same prefix reuses it there
and recomputes it anywhere else. Precise prefix-aware routers (llm-d's) keep an index from
a prompt's leading block hashes to the pods holding them; the scheduler does not tokenize,
so its "blocks" are the chat's leading messages, hashed in a chain as the engine chains
token blocks (DESIGN §2), seeded by the tenant and model so that tenants never share an
entry::

    h0 = H(tenant, model, tools)   h1 = H(h0, message 0)   h2 = H(h1, message 1) ...

The prefix of a prompt is every message but the last (the new input). The map is fed by
the turns that end on a node and by the save reports its heartbeats carry (the node's
kvstore then holds the blocks), bounded (least recently used first), and answers with the
nodes holding the longest known prefix, most recent first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from shared.session_key import SessionKey

LEADING_MESSAGES = 8  # hashed at most: shared context sits at the start of a chat
NODES_PER_PREFIX = 4


def prompt_prefix(tenant: str, model: str, tools_json: str,
                  messages: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """The chain of hashes of a chat's leading context ((role, content) pairs; the last
    message, the turn's new input, is left out). Empty for a prompt of one message."""
    if len(messages) < 2:
        return ()
    h = hashlib.blake2b(f"{tenant}\0{model}\0{tools_json}".encode(), digest_size=16)
    out = []
    for role, content in messages[:-1][:LEADING_MESSAGES]:
        h = hashlib.blake2b(h.digest() + f"{role}\0{content}".encode(), digest_size=16)
        out.append(h.hexdigest())
    return tuple(out)


class PrefixMap:
    """Event-loop only."""

    def __init__(self, capacity: int = 100_000, sessions: int = 100_000) -> None:
        self.capacity = capacity
        self.sessions_max = sessions
        self._nodes: OrderedDict[str, list[str]] = OrderedDict()  # hash -> nodes, newest last
        self._of_session: OrderedDict[SessionKey, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def turn_ended(self, tenant: str, session_id: str, prefix: tuple[str, ...],
                   node_id: str) -> None:
        """A turn with this prefix ended on ``node_id`` (its blocks are there now)."""
        if session_id and prefix:
            key = SessionKey(tenant, session_id)
            self._of_session.pop(key, None)
            self._of_session[key] = prefix
            while len(self._of_session) > self.sessions_max:
                self._of_session.popitem(last=False)
        self.record(prefix, node_id)

    def saved(self, tenant: str, session_id: str, node_id: str) -> None:
        """``node_id`` reported the session saved: its kvstore holds the session's prefix."""
        prefix = self._of_session.get(SessionKey(tenant, session_id))
        if prefix:
            self.record(prefix, node_id)

    def record(self, prefix: tuple[str, ...], node_id: str) -> None:
        for h in prefix:
            nodes = self._nodes.pop(h, [])
            if node_id in nodes:
                nodes.remove(node_id)
            nodes.append(node_id)
            self._nodes[h] = nodes[-NODES_PER_PREFIX:]
        while len(self._nodes) > self.capacity:
            self._nodes.popitem(last=False)

    def holders(self, prefix: tuple[str, ...]) -> tuple[str, ...]:
        """The nodes holding the longest known part of ``prefix``, most recent first."""
        for h in reversed(prefix):
            nodes = self._nodes.get(h)
            if nodes:
                self._nodes.move_to_end(h)
                return tuple(reversed(nodes))
        return ()

    def forget_node(self, node_id: str) -> None:
        for h in [h for h, nodes in self._nodes.items() if node_id in nodes]:
            left = [n for n in self._nodes[h] if n != node_id]
            if left:
                self._nodes[h] = left
            else:
                del self._nodes[h]
