"""The OpenAI Responses API (``POST /v1/responses``): what the OpenAI Agents SDK speaks.

A chain of responses linked by ``previous_response_id`` is one session: its history is
kept here (per tenant, with a TTL), rendered like a chat, and its KV is reused and can be
advised like any conversation's (the session id is the chain's first response id).
"""

from .api import add_responses_routes
from .store import ResponseStore

__all__ = ["ResponseStore", "add_responses_routes"]
