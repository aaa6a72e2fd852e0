"""The one name of a conversation across the cluster: ``SessionKey(tenant, session_id)``.

A session id is only unique within its tenant (two tenants may both say "chat-1"), so
every map from sessions to something (KV locations, advisories, prefetches, manifests,
requests in flight) is keyed by the pair. A NamedTuple: hashable, ordered, cheap, and
still unpacks as ``tenant, session_id = key``.
"""

from __future__ import annotations

from typing import NamedTuple


class SessionKey(NamedTuple):
    tenant: str
    session_id: str

    def __str__(self) -> str:
        return f"{self.tenant}/{self.session_id}"
