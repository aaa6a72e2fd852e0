"""The sessions this kvstore holds on its own tiers, a page at a time: what a restarted
scheduler rebuilds its session directory from.

The scheduler learns where a session's KV is from the turns it routes and the saves the
nodes report; all of it in its memory, and the node manager's record of its saves
(``nodemgr/held_sessions.py``) is in memory too. Only the kvstores know durably what they
hold: a manifest is written once its chunks are durable (on the SSD tier when the node
has one), and the latest sequence of each session is remembered before that. So after a
restart of the scheduler, of a node manager or of the whole node, the node manager pages
through this listing and reports the sessions with its registration.

Listed: the sessions remembered in memory (``LatestSequences``) and every manifest on a
tier of this node (DRAM, SSD; never the shared S3, which every node reads: a session
there is no reason to route to this one). By key (``tenant/session@model``), after a
cursor, at most ``limit`` (capped by ``MAX_PAGE``): a listing is bounded work however many
sessions the disk holds, and the caller bounds how many pages it takes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.kvstore.errors import TierUnavailable
from services.kvstore.manifests.manifest import Manifest
from services.kvstore.manifests.manifest_store import ManifestStore
from services.kvstore.store.keys import MANIFEST_PREFIX
from services.kvstore.tiers import DramTier, SsdTier
from shared.chunk_codec import ChunkFormatError
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

MAX_PAGE = 1024  # sessions per page at most (each may read one manifest from the SSD)


@dataclass(frozen=True)
class StoredSession:
    tenant: str
    session_id: str  # as the scheduler knows it (the model's scope taken off)
    tokens: int  # tokens of the saved sequence
    age_s: float  # since it was saved


def _unscoped(scoped: str) -> str:
    """The session's own id inside its per-model name (``scoped_session``)."""
    return scoped.rpartition("@")[0] or scoped


async def list_sessions(manifests: ManifestStore, after: str = "", limit: int = MAX_PAGE
                        ) -> tuple[list[StoredSession], str]:
    """Up to ``limit`` sessions whose manifest key sorts after ``after``; and the cursor of
    the next page ("": this was the last)."""
    limit = max(1, min(limit, MAX_PAGE))
    local = [t for t in manifests.store.tiers
             if isinstance(t, DramTier | SsdTier) and t.name != "s3"]
    keys = {f"{sid.tenant}/{sid.session_id}" for sid in manifests.sequences}
    for tier in local:
        keys.update(k[len(MANIFEST_PREFIX):] for k in tier.keys()
                    if k.startswith(MANIFEST_PREFIX))
    page = sorted(k for k in keys if k > after)
    more = len(page) > limit
    page = page[:limit]
    out: list[StoredSession] = []
    now = time.time()
    for key in page:
        tenant, _, scoped = key.partition("/")
        manifest = (manifests.sequences.manifest(SessionKey(tenant, scoped))
                    or await _local_manifest(local, key))
        if manifest is not None:
            out.append(StoredSession(tenant, _unscoped(scoped), manifest.token_count,
                                     max(0.0, now - manifest.updated)))
    return out, (page[-1] if more and page else "")


async def _local_manifest(tiers: list[DramTier | SsdTier], key: str) -> Manifest | None:
    """The manifest ``key`` from this node's own tiers (None: gone meanwhile, unreadable)."""
    for tier in tiers:
        try:
            blob = await tier.get(MANIFEST_PREFIX + key)
        except TierUnavailable:
            continue
        if blob is None:
            continue
        try:
            return Manifest.decode(bytes(blob), key)
        except ChunkFormatError as e:  # (a read of it refuses it too, and recomputes)
            log.warning("unreadable manifest %s in %s: %s", key, tier.name, e)
    return None
