"""The OpenAI Responses API (``POST /v1/responses``): what the OpenAI Agents SDK speaks.

A chain of responses linked by ``previous_response_id`` is one session: its history is
kept here (per tenant, with a TTL), rendered like a chat, and its KV is reused and can be
advised like any conversation's (the session id is the chain's first response id). The
routes are in ``http/responses.py``; this package holds the store, its archive (local
disk or the shared S3, so chains survive a scheduler restart) and the items.
"""

from services.scheduler.responses.archive import ResponseArchive
from services.scheduler.responses.choose import response_archive
from services.scheduler.responses.store import ResponseStore, StoredResponse

__all__ = ["ResponseArchive", "ResponseStore", "StoredResponse", "response_archive"]
