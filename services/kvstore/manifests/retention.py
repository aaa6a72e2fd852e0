"""Per-session retention: OpenAI's ``prompt_cache_retention`` as a TTL the tiers honour.

A save may carry ``retain_s`` (the scheduler maps ``"in_memory"`` and ``"24h"`` to seconds
by its config; this kvstore bounds it by ``kvstore.ttl_s``). The manifest records it, and
the ``RetentionIndex`` keeps each such session's newest manifest, so that:

- the session **expires** at ``updated + retain_s`` (its last save plus its retention):
  ``retention_sweep.sweep_retention`` deletes its manifest from every tier and its chunks
  from every tier where nobody used them since that save (a chunk another session read
  later, a shared system prompt, stays under the tiers' own TTLs). With a shared lowest
  tier (S3) its copies there are left to that tier's TTL: another node's manifest may
  name them;
- until then its chunks and manifest **outlive** the local tiers' idle TTL
  (``local_ttl_s``) if the retention is longer: the ``Sweeper`` skips ``kept_keys``.

The index is bounded (``max_sessions``): past it the session noted longest ago falls back to
the tiers' TTLs. It lives in memory: after a restart the tiers' TTLs apply again (the
manifests still say what was asked).
"""

from __future__ import annotations

from collections import OrderedDict

from services.kvstore.manifests.manifest import Manifest
from services.kvstore.store.keys import chunk_tier_key, manifest_tier_key
from shared.session_key import SessionKey

SWEEP_BATCH = 256  # sessions one pass expires at most (the rest wait for the next pass)


class RetentionIndex:
    """The newest manifest of each session saved with a retention, oldest noted first."""

    def __init__(self, max_retain_s: float, max_sessions: int = 100_000) -> None:
        self.max_retain_s = max_retain_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[SessionKey, Manifest] = OrderedDict()

    def bound(self, retain_s: float) -> float:
        """``retain_s`` as this kvstore keeps it: at most its lowest tier's TTL."""
        return min(max(retain_s, 0.0), self.max_retain_s)

    def note(self, manifest: Manifest) -> None:
        """``manifest`` is the session's newest save: its retention (or none) applies."""
        sid = SessionKey(manifest.tenant, manifest.session_id)
        self._sessions.pop(sid, None)
        if manifest.retain_s <= 0:
            return  # a turn without a retention: the tiers' TTLs again
        self._sessions[sid] = manifest
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def drop(self, sid: SessionKey) -> None:
        self._sessions.pop(sid, None)

    def get(self, sid: SessionKey) -> Manifest | None:
        return self._sessions.get(sid)

    def __len__(self) -> int:
        return len(self._sessions)

    def expired(self, now: float, limit: int = SWEEP_BATCH) -> list[Manifest]:
        """Up to ``limit`` sessions whose retention has run out at ``now`` (removed)."""
        out = [m for m in self._sessions.values() if m.updated + m.retain_s <= now][:limit]
        for m in out:
            del self._sessions[SessionKey(m.tenant, m.session_id)]
        return out

    def kept_keys(self, now: float) -> set[str]:
        """Tier keys (chunks and manifests) of the sessions still retained at ``now``."""
        keys: set[str] = set()
        for m in self._sessions.values():
            if m.updated + m.retain_s > now:
                keys.add(manifest_tier_key(m.key))
                keys.update(chunk_tier_key(k) for k in m.chunk_keys())
        return keys
