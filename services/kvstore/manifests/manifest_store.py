"""Session manifests in the tiers: written only once every chunk they name is durable.

A manifest names a session's chunks (its block hashes, chunked); a lookup for the next
turn, a peer pull or a restarted node reads it to find the session's KV. It lives in the
lowest tier (the authority, shared between nodes) with a copy in the local ones, beside
the chunks, and is never written naming a chunk the lowest tier does not hold: each named
chunk is confirmed durable by the ``DurabilityLedger`` (asking the lowest tier when it
does not know) or written down again from a local copy first.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections import OrderedDict
from collections.abc import Collection

from services.kvstore.errors import ManifestIncomplete, TierUnavailable
from services.kvstore.manifests.latest import LATEST_SESSIONS, LatestSequences, SavedSequence
from services.kvstore.manifests.manifest import Manifest, manifest_key
from services.kvstore.manifests.save_waits import SaveWaits
from services.kvstore.store import TieredStore
from services.kvstore.store.keys import chunk_tier_key, manifest_tier_key
from shared.chunk_codec import Chunk, ChunkFormatError
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

MANIFEST_PRIORITY = 1 << 30  # local tiers never evict a manifest before a chunk
DURABLE_CHECK_BATCH = 1024  # chunks a manifest checks at once


class ManifestStore:
    """Durable manifests over ``store``'s tiers, and each session's latest saved sequence
    (``remember``, kept in ``sequences``) with its manifest write in the background: the
    next turn's lookup sees a save at once, and the manifest lands once its chunks are
    durable, newest last.

    An async context manager: leaving it lets pending manifest writes finish (up to
    ``drain_s``), then cancels the rest."""

    def __init__(self, store: TieredStore, drain_s: float = 5.0) -> None:
        self.store = store
        self.ledger = store.ledger
        self.drain_s = drain_s
        self.sequences = LatestSequences()  # each session's latest, and its manifest
        # Per session: the manifest task of its latest sequence, and every manifest task
        # still running (a superseded one that is writing runs to its end).
        self._manifests: dict[SessionKey, asyncio.Task[None]] = {}
        self._tasks: dict[SessionKey, set[asyncio.Task[None]]] = {}
        self._writing: set[asyncio.Task[None]] = set()  # manifest tasks past their checks
        # Sessions deleted (``forget``) while a save may have been under way: a save that
        # started before the delete must not bring the session back.
        self._forgets = itertools.count(1)
        self._forgotten: OrderedDict[SessionKey, int] = OrderedDict()
        self.saves = SaveWaits()  # saves in flight, for peers asking for the next turn

    async def __aenter__(self) -> ManifestStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = self._all_tasks()
        if tasks:
            await asyncio.wait(tasks, timeout=self.drain_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._manifests.clear()
        self._tasks.clear()

    async def get_layer(self, manifest: Manifest, layer: int) -> list[Chunk | None]:
        """The chunks of one layer of a session, in token order (``None`` = miss)."""
        keys = manifest.layer_keys(layer)
        return list(await asyncio.gather(*(self.store.get(k) for k in keys)))

    async def put_manifest(self, manifest: Manifest, wait_s: float = 30.0) -> None:
        """Write ``manifest`` once every chunk it names is durable; else ``ManifestIncomplete``.

        Chunks still being written behind are waited for, up to ``wait_s`` seconds.
        Raises ``TierUnavailable`` if the lowest tier cannot take the manifest itself.
        """
        await self.wait_durable(manifest, wait_s)
        await self.write_manifest(manifest)

    async def wait_durable(self, manifest: Manifest, wait_s: float = 30.0) -> None:
        """Return once every chunk ``manifest`` names is durable in the lowest tier (writes
        in flight waited for up to ``wait_s``); else raise ``ManifestIncomplete``.

        A chunk held here but not in the lowest tier is written down again first: its
        write may have been queued when an earlier process stopped (what was unsaved is
        not remembered across restarts), or dropped from a full queue."""
        keys = manifest.chunk_keys()
        settled = [k for k in keys if self.ledger.in_flight(k) is None]
        # In batches, stopping at the first batch with a chunk that cannot be had: a
        # manifest naming many chunks this store never saw costs one batch of checks.
        for i in range(0, len(settled), DURABLE_CHECK_BATCH):
            await self._settle(manifest, settled[i : i + DURABLE_CHECK_BATCH])
        pending = {k: f for k in keys if (f := self.ledger.in_flight(k)) is not None}
        if pending:
            await asyncio.wait([asyncio.shield(f) for f in pending.values()], timeout=wait_s)
            late = sum(1 for f in pending.values() if not f.done())
            if late:
                raise ManifestIncomplete(
                    f"manifest {manifest.key}: {late} chunks still not durable after {wait_s}s")
            # A completed write vouches only if nothing deleted its chunk meanwhile.
            for k in pending:
                if not self.ledger.acknowledged(k) and not await self.ledger.durable_for_a_ttl(k):
                    raise ManifestIncomplete(
                        f"manifest {manifest.key}: chunk {k} was lost while written")

    async def _settle(self, manifest: Manifest, keys: list[str]) -> None:
        """Chunks ``keys`` (none in flight) durable, or written down again from a local
        copy (in flight then); else ``ManifestIncomplete``."""
        durable = self.ledger.durable_for_a_ttl
        known = dict(zip(keys, await asyncio.gather(*(durable(k) for k in keys)), strict=False))
        unknown = [k for k, ok in known.items() if ok is None]
        if unknown and self.store.lowest.stats().healthy:
            # Refused by a tier that was degraded, and has answered since (its first check
            # was the probe that healed it): ask once more.
            known.update(zip(unknown, await asyncio.gather(
                *(durable(k) for k in unknown)), strict=False))
            unknown = [k for k in unknown if known[k] is None]
        if unknown:  # not known absent: nothing to write again, but not known durable
            raise ManifestIncomplete(
                f"manifest {manifest.key}: {self.store.lowest.name} did not answer for "
                f"{len(unknown)} chunks ({unknown[0]})")
        missing = [k for k, ok in known.items() if ok is False]
        if missing:
            lost = await self._write_down_again(missing)
            if lost:
                raise ManifestIncomplete(
                    f"manifest {manifest.key}: chunks are not durable in the lowest tier "
                    f"({lost[0]})")

    async def _write_down_again(self, keys: list[str]) -> list[str]:
        """Queue the lowest-tier write of each chunk in ``keys`` from a local copy (DRAM, or
        a local tier's, checked first); the keys with no copy here (or, while the lowest
        tier is unhealthy, every key: its queue would only churn)."""
        if self.store.lowest is self.store.dram or not self.store.lowest.stats().healthy:
            return keys
        lost = []
        for key in keys:
            blob = await self.store.local_copy(key)
            if self.ledger.in_flight(key) is not None:
                continue  # a put of it started meanwhile: its write covers it
            if blob is None or not self.store.held_locally(chunk_tier_key(key)):
                lost.append(key)  # (deleted while we read it: not to be brought back)
                continue
            log.info("chunk %s is held here but not in %s: writing it again", key,
                     self.store.lowest.name)
            self.store.write_down(key, blob)
        return lost

    async def write_manifest(self, manifest: Manifest) -> None:
        """Write ``manifest`` to the lowest tier, then the local ones (``put_manifest``
        without the durability check: only after ``wait_durable``)."""
        blob = manifest.encode()
        tkey = manifest_tier_key(manifest.key)
        # Lowest tier first: it is the authority; the SSD copy only speeds up local reads.
        await self.store.io.put(self.store.lowest, tkey, blob, MANIFEST_PRIORITY)
        for tier in self.store.tiers[1:-1]:
            try:
                await self.store.io.put(tier, tkey, blob, MANIFEST_PRIORITY)
            except TierUnavailable as e:
                log.warning("local manifest copy of %s failed: %s", manifest.key, e)

    async def get_manifest(self, tenant: str, session_id: str) -> Manifest | None:
        """The session's manifest from the lowest reachable tier below DRAM, or ``None``."""
        tkey = manifest_tier_key(manifest_key(tenant, session_id))
        for tier in reversed(self.store.tiers[1:] or self.store.tiers):
            try:
                blob = await tier.get(tkey)
            except TierUnavailable:
                continue
            if blob is not None:
                try:
                    return Manifest.decode(blob, manifest_key(tenant, session_id))
                except ChunkFormatError as e:
                    log.warning("unreadable manifest %s in %s: %s", tkey, tier.name, e)
                    self.store.metrics.checksum_failures.labels(tier.name).inc()
                    try:
                        await tier.delete(tkey)
                    except TierUnavailable as err:  # it stays unreadable: still a miss
                        log.warning("could not delete %s from %s: %s", tkey, tier.name, err)
        return None

    async def delete_manifest(
        self, tenant: str, session_id: str, tiers: Collection[str] = ()
    ) -> int:
        tkey = manifest_tier_key(manifest_key(tenant, session_id))
        return await self.store.delete_entry(tkey, tiers)

    # ---------------------------------------------------------------- sessions in memory

    async def newest_manifest(self, tenant: str, session_id: str) -> Manifest | None:
        """The session's newest manifest: the one saved here last, whose chunks are in
        this store though maybe not yet durable below, else the durable one."""
        newest = self.sequences.manifest(SessionKey(tenant, session_id))
        return newest if newest is not None else await self.get_manifest(tenant, session_id)

    def model_scopes(self, tenant: str, session_id: str) -> list[str]:
        """The per-model names (``scoped_session``) of the session saved here and still
        remembered: what a caller naming the session without its model means."""
        return self.sequences.model_scopes(tenant, session_id)

    def latest(self, tenant: str, session_id: str) -> SavedSequence | None:
        """The session's latest saved sequence, if still remembered."""
        return self.sequences.get(SessionKey(tenant, session_id))

    def deletions(self, tenant: str, session_id: str) -> int | None:
        """A mark of the session's deletions so far: a save compares it before and after
        its work (``remember(..., deleted_before=)``)."""
        return self._forgotten.get(SessionKey(tenant, session_id))

    def remember(self, seq: SavedSequence, manifest: Manifest,
                 deleted_before: int | None) -> None:
        """The next turn's lookup sees ``seq`` now; its manifest follows once durable. A
        session deleted since ``deleted_before`` was taken stays deleted."""
        sid = SessionKey(manifest.tenant, manifest.session_id)
        if self._forgotten.get(sid) != deleted_before:
            return
        self.sequences.note(sid, seq, manifest)
        old = self._manifests.pop(sid, None)
        if old is not None and old not in self._writing:
            old.cancel()  # a newer sequence of the session supersedes it
        task = asyncio.create_task(self._write_latest(manifest, sid),
                                   name=f"manifest-{sid.session_id}")
        self._manifests[sid] = task
        self._tasks.setdefault(sid, set()).add(task)
        task.add_done_callback(functools.partial(self._manifest_done, sid))

    def adopt(self, manifest: Manifest, deleted_before: int | None) -> bool:
        """A session's chunks were copied here (staged for an advisory): lookups see its
        sequence as this node's own. No manifest is written: its holder writes that. Not
        when the session was deleted since ``deleted_before`` (``deletions()`` taken when
        the copy began) or this node already knows as long a sequence of it (a turn that
        ran here meanwhile): whether it was adopted."""
        sid = SessionKey(manifest.tenant, manifest.session_id)
        if self._forgotten.get(sid) != deleted_before:
            return False
        known = self.sequences.get(sid)
        if known is not None and known.token_count >= manifest.token_count:
            return False
        seq = SavedSequence(manifest.model_fp, manifest.block_hashes, manifest.token_count,
                            manifest.num_layers)
        self.sequences.note(sid, seq, manifest)
        return True

    def _manifest_done(self, sid: SessionKey, task: asyncio.Task[None]) -> None:
        if self._manifests.get(sid) is task:
            del self._manifests[sid]
        live = self._tasks.get(sid)
        if live is not None:
            live.discard(task)
            if not live:
                del self._tasks[sid]

    def _all_tasks(self) -> list[asyncio.Task[None]]:
        return [t for live in self._tasks.values() for t in live]

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session is being deleted: stop offering its latest sequence to lookups, and
        return only when no manifest of it can be written any more (a pending one is
        cancelled; one being written is waited for, so the caller's delete comes after)."""
        sid = SessionKey(tenant, session_id)
        self.sequences.drop(sid)
        self.saves.forget(sid)
        self._forgotten[sid] = next(self._forgets)  # a save under way will not remember it
        self._forgotten.move_to_end(sid)
        while len(self._forgotten) > LATEST_SESSIONS:
            self._forgotten.popitem(last=False)
        self._manifests.pop(sid, None)
        tasks = list(self._tasks.get(sid, ()))
        for task in tasks:
            if task not in self._writing:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _write_latest(self, manifest: Manifest, sid: SessionKey) -> None:
        me = asyncio.current_task()
        try:
            await self.wait_durable(manifest)
            if self._manifests.get(sid) is not me:
                return  # superseded, or the session was deleted meanwhile
            assert me is not None
            self._writing.add(me)  # from here on it is not cancelled: its put must land
            try:
                # An older manifest of the session still being written lands first, so the
                # newest is the one that stays; then check again that this one is wanted.
                older = [t for t in self._tasks.get(sid, ()) if t is not me and t in self._writing]
                if older:
                    await asyncio.gather(*older, return_exceptions=True)
                    if self._manifests.get(sid) is not me:
                        return
                await self.write_manifest(manifest)
            finally:
                self._writing.discard(me)
        except (ManifestIncomplete, TierUnavailable, ChunkFormatError) as e:
            log.warning("manifest of %s not written: %s", manifest.key, e)
            self.sequences.drop_manifest(sid, manifest)

    async def wait_pending(self) -> None:
        """Wait for the background manifest writes pending now (tests, shutdown)."""
        await asyncio.gather(*self._all_tasks(), return_exceptions=True)
