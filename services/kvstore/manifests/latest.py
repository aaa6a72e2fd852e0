"""Each session's latest saved sequence, in memory: the next turn's lookup sees a save at
once, before its manifest is durable, and a peer or a GetManifest gets that sequence's
manifest (its chunks are in this store, though maybe not yet durable below).

Bounded by sessions and by block hashes in all (~60 bytes each): the least recently saved
are forgotten first; their lookups then read the durable manifest instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from services.kvstore.manifests.manifest import Manifest
from shared.session_key import SessionKey

LATEST_SESSIONS = 10_000
LATEST_HASHES = 1 << 20


@dataclass(frozen=True)
class SavedSequence:
    """The latest sequence saved for a (tenant, session): lookups use it before the
    durable manifest exists."""

    model_fp: str
    block_hashes: tuple[bytes, ...]
    token_count: int
    num_layers: int


class LatestSequences:
    """Per session its latest ``SavedSequence`` and the manifest naming it, least recently
    saved first."""

    def __init__(self) -> None:
        self._seqs: OrderedDict[SessionKey, SavedSequence] = OrderedDict()
        self._manifests: dict[SessionKey, Manifest] = {}
        self.hashes = 0  # block hashes remembered, over every session

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, sid: object) -> bool:
        return sid in self._seqs

    def __iter__(self) -> Iterator[SessionKey]:
        """The sessions remembered, least recently saved first."""
        return iter(self._seqs)

    def get(self, sid: SessionKey) -> SavedSequence | None:
        return self._seqs.get(sid)

    def manifest(self, sid: SessionKey) -> Manifest | None:
        """The manifest of the session's latest sequence, unless it failed to be written."""
        return self._manifests.get(sid)

    def note(self, sid: SessionKey, seq: SavedSequence, manifest: Manifest) -> None:
        """``seq`` (named by ``manifest``) is the session's latest; the oldest sessions
        are forgotten past the bounds."""
        self.drop(sid)
        self._seqs[sid] = seq
        self._manifests[sid] = manifest
        self.hashes += len(seq.block_hashes)
        while len(self._seqs) > LATEST_SESSIONS or (
                self.hashes > LATEST_HASHES and len(self._seqs) > 1):
            self.drop(next(iter(self._seqs)))

    def drop(self, sid: SessionKey) -> None:
        seq = self._seqs.pop(sid, None)
        self._manifests.pop(sid, None)
        if seq is not None:
            self.hashes -= len(seq.block_hashes)

    def drop_manifest(self, sid: SessionKey, manifest: Manifest) -> None:
        """``manifest`` was not written (its chunks may be gone): peers get the durable
        one from now on, if it is still the session's newest."""
        if self._manifests.get(sid) is manifest:
            del self._manifests[sid]

    def model_scopes(self, tenant: str, session_id: str) -> list[str]:
        """The per-model names (``scoped_session``) of the session remembered here."""
        prefix = session_id + "@"
        return [s for t, s in self._seqs if t == tenant and s.startswith(prefix)]
