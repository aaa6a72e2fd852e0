"""TieredStore: the kvstore's in-process API over DRAM → SSD → S3 (DESIGN §3).

Contract for callers (the gRPC service, and later the engine hand-off of Symphony core):

- ``put(meta, tensor)`` copies the tensor into a chunk blob and lands it in DRAM before
  its first await returns control: when ``put`` returns, the caller may reuse/unpin the
  source memory. The returned ``PutReceipt.durable`` future resolves once the chunk is in
  the lowest configured tier (fails with ``WriteDropped`` if the write-behind queue had to
  drop it). Awaiting it is optional.
- ``get(key)`` searches DRAM, then SSD, then S3; a hit in a lower tier is verified
  (checksum), promoted to DRAM (and SSD), and returned as a ``Chunk`` whose tensor views the
  stored blob (read-only; copy it into the pool). A miss, an unreachable tier and a corrupt
  copy all yield ``None`` (corrupt copies are counted and deleted).
- ``get_layer(manifest, layer)`` returns that layer's chunks in token order (``None`` for
  missing ones); ``streaming.stream_session`` yields them lowest layer first with a
  bounded read-ahead.
- ``put_manifest`` waits for the chunks it names to be durable, then writes the manifest
  to the lowest tier (and SSD); raises ``ManifestIncomplete`` otherwise, so a manifest
  never points at missing data. ``get_manifest`` prefers the lowest tier (authoritative,
  shared between nodes) and falls back to SSD.
- Safe for many concurrent callers on one event loop; not thread-safe.

Engine hand-off (the shape the pool wants; the store itself accepts any shape/dtype; the
same-node path that does it over a mapped pool is ``pool_path.PoolDataPath``)::

    pool (per engine):  kv_cache (num_blocks, 2, block_size, kv_heads, head_dim)
    one chunk:          kv_cache[block_ids_of_layer_l[c0:c1]]       # gather, a copy
                        -> (n_blocks, 2, block_size, kv_heads, head_dim), n_blocks <= chunk
    save:   await store.put(ChunkMeta(tenant, fp, l, hashes[c0:c1]), chunk)  # then unpin
    load:   c = await store.get(key);  kv_cache[free_ids] = c.tensor         # scatter
            layer by layer: for l in range(L): await store.get_layer(manifest, l)

``ChunkMeta.block_hashes`` are the chained block hashes of exactly the blocks in the
chunk; the key uses the last one, so a prefix of a session hits the same chunk keys as
long as its chunks end on the same blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.kvstore.checksum_work import checksum_work
from services.kvstore.errors import (
    ManifestIncomplete,
    TierUnavailable,
    WriteDropped,
    WriteRefused,
)
from services.kvstore.manifest import Manifest, manifest_key
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store_io import TierIO
from services.kvstore.sweeper import sweep_loop, sweep_tiers
from services.kvstore.tiers.base import Blob, Checked, Stored, Tier, TierStats
from services.kvstore.tiers.dram import DramTier
from services.kvstore.write_behind import RECENT_DROPS_S, WriteBehind
from shared.chunk_codec import (
    Chunk,
    ChunkCorrupt,
    ChunkMeta,
    decode_chunk,
    encode_chunk,
    parse_head,
    seal_chunk,
    verify_chunk,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_C = "c/"  # tier key prefix of chunks
_M = "m/"  # tier key prefix of manifests
MANIFEST_PRIORITY = 1 << 30  # local tiers never evict a manifest before a chunk
_DURABLE_MEMORY = 100_000  # keys remembered as durable, to spare HEAD calls on manifests
DURABLE_CHECK_BATCH = 1024  # chunks a manifest checks at once


def chunk_tier_key(key: str) -> str:
    """The key under which the tiers hold chunk ``key`` (what a read's ``Stored.key`` says)."""
    return _C + key


def _decode_trusted(blob: Blob) -> Chunk:
    """A DRAM blob's chunk: trusted (it never left the process), so no checksum."""
    return decode_chunk(blob, verify=False)


def decode_stored(hit: Stored) -> Chunk:
    """The default check of a lower tier's hit: the whole blob, verified and decoded."""
    return decode_chunk(hit.blob())


def layer_priority(layer: int) -> int:
    """Default eviction priority: later layers are evicted first (Symphony §3.3)."""
    return -layer


@dataclass(slots=True)
class PutReceipt:
    key: str
    durable: asyncio.Future[None]


class TieredStore:
    def __init__(
        self,
        tiers: list[Tier],
        metrics: KVStoreMetrics,
        *,
        write_queue: int = 1024,
        write_workers: int = 4,
        retry_backoff_max_s: float = 5.0,
        local_ttl_s: float = 86400.0,
        ttl_s: float = 7 * 86400.0,
        sweep_interval_s: float = 30.0,
        drain_s: float = 5.0,
    ) -> None:
        if not tiers or not isinstance(tiers[0], DramTier):
            raise ValueError("the first tier must be a DramTier")
        self.tiers = tiers
        self.dram: DramTier = tiers[0]
        self.lowest = tiers[-1]
        self.metrics = metrics
        self.io = TierIO(metrics)
        self.local_ttl_s, self.ttl_s = local_ttl_s, ttl_s
        self.sweep_interval_s, self.drain_s = sweep_interval_s, drain_s
        self.writer = WriteBehind(
            self._write_below, metrics, write_queue, write_workers,
            backoff_max_s=retry_backoff_max_s, undo=self._undo_write,
        )
        self._below_dram = tiers[1:]
        self._landed_fut: asyncio.Future[None] | None = None
        self._inflight: dict[str, asyncio.Future[None]] = {}
        # What the store vouches for without asking the lowest tier (manifests are written
        # on it): chunks acknowledged durable by this process and not lost since. A write
        # vouches only if it is still the chunk's latest (``_write_gen``): a delete or a
        # newer put in the meantime voids it.
        self._durable: OrderedDict[str, float] = OrderedDict()  # key -> when written
        self._write_gen: dict[str, int] = {}
        self._gens = itertools.count()
        # Chunks whose durable write was dropped (queue full, refused): a save must write
        # them again rather than skip them as already stored.
        self._unsaved: OrderedDict[str, None] = OrderedDict()
        # Tier keys the sweep is deciding on in the lowest tier: not durable for a manifest
        # meanwhile, since its delete may land after a manifest checked the chunk.
        self.sweeping: set[str] = set()
        # Tier keys being read below DRAM (count of reads), and those of them put or
        # deleted meanwhile: such a read must not promote what it found (an older copy
        # would replace the newer one in DRAM, or bring a deleted chunk back).
        self._reading: dict[str, int] = {}
        self._changed_while_read: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._opened: list[Tier] = []

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> TieredStore:
        try:
            for tier in self.tiers:
                await tier.open()
                self._opened.append(tier)
        except BaseException:
            await self._close_tiers()
            raise
        await self.writer.start()
        self._sweeper = asyncio.create_task(sweep_loop(self), name="kv-sweeper")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self.writer.close(self.drain_s)
        await self._close_tiers()

    async def _close_tiers(self) -> None:
        for tier in reversed(self._opened):
            try:
                await tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)
        self._opened = []

    @property
    def local_tiers(self) -> list[Tier]:
        """Tiers below DRAM that the write-behind fills (SSD and the lowest, in order)."""
        return self._below_dram

    # ---------------------------------------------------------------- chunks

    async def put(
        self, meta: ChunkMeta, tensor: torch.Tensor, priority: int | None = None
    ) -> PutReceipt:
        """Encode ``tensor`` as chunk ``meta`` into DRAM now; write it behind. See module doc."""
        blob = encode_chunk(meta, tensor, seal=False)
        return self._admit(
            meta.key, blob, layer_priority(meta.layer) if priority is None else priority
        )

    async def put_blob(self, blob: Blob, priority: int | None = None) -> PutReceipt:
        """Store an already encoded, sealed chunk (from a peer or a client); verifies it first.

        Raises ``ChunkCorrupt`` (nothing stored) if the blob fails its checksum or is not a
        well-formed chunk (its header is parsed as strictly as a read parses it, so nothing
        stored here can fail a later read for its form).
        """
        await checksum_work(verify_chunk, blob)
        meta = parse_head(blob, len(blob)).meta
        return self._admit(
            meta.key, blob, layer_priority(meta.layer) if priority is None else priority
        )

    def put_encoded(
        self, meta: ChunkMeta, blob: bytearray, priority: int | None = None
    ) -> PutReceipt:
        """Admit a blob this process just built with ``encode_chunk(meta, t, seal=False)``.

        Synchronous (in DRAM when it returns), so heavy encoding can run on a worker thread
        first (the pool save path). The blob is trusted like a ``put``'s: no checksum.
        """
        return self._admit(
            meta.key, blob, layer_priority(meta.layer) if priority is None else priority
        )

    def _admit(self, key: str, blob: Blob, priority: int) -> PutReceipt:
        tier_key = _C + key
        if self._reading and tier_key in self._reading:
            self._changed_while_read.add(tier_key)
        self.io.dram_put(self.dram, tier_key, blob, priority)
        if self._unsaved:
            self._unsaved.pop(key, None)
        if not self._below_dram:
            # DRAM is the only tier: durable as it lands, and its own index (no I/O) says
            # so to ``_durable_for_a_ttl``: nothing to remember.
            self._durable.pop(key, None)
            return PutReceipt(key, self._landed())
        return PutReceipt(key, self._write_behind(key, blob, priority, self._below_dram))

    def _write_behind(self, key: str, blob: Blob, priority: int, targets: list[Tier]
                      ) -> asyncio.Future[None]:
        """Queue chunk ``key`` for ``targets`` (the lowest last); its ack makes the store
        vouch for it, if nothing replaced or deleted it meanwhile (``_written``)."""
        self._durable.pop(key, None)
        self._unsaved.pop(key, None)
        gen = self._write_gen[key] = next(self._gens)
        fut = self.writer.submit(_C + key, blob, priority, targets, durable=True)
        self._inflight[key] = fut
        fut.add_done_callback(lambda f, k=key, g=gen: self._written(k, g, f))
        return fut

    def _written(self, key: str, gen: int, fut: asyncio.Future[None]) -> None:
        """A chunk's write-behind ended: vouch for it only if nothing replaced or deleted
        the chunk meanwhile; a dropped write leaves it to be written again."""
        if self._inflight.get(key) is fut:
            del self._inflight[key]
        if self._write_gen.get(key) != gen:
            return
        del self._write_gen[key]
        if fut.cancelled() or fut.exception() is not None or (
                self.sweeping and _C + key in self.sweeping):
            # (a sweep's delete of the chunk may land after this write: never vouch then)
            self._mark_unsaved(key)
        else:
            self._remember_durable_chunk(key)

    async def _write_below(self, tier: Tier, tier_key: str, blob: Blob, priority: int) -> None:
        """The write-behind's put: a lowest tier that evicts for it loses those keys (no
        more vouching for them), and one that cannot take the blob at all refuses it."""
        evicted = await self.io.put(tier, tier_key, blob, priority)
        if tier_key in evicted:
            raise WriteRefused(f"{tier_key} ({len(blob)} bytes) does not fit {tier.name}")
        if tier is self.lowest:
            for k in evicted:
                self.forget_durable(k)

    def _landed(self) -> asyncio.Future[None]:
        """A resolved future for receipts with nothing to wait for (one per loop: a put to
        a DRAM-only store should not pay for a future of its own)."""
        fut = self._landed_fut
        if fut is None or fut.get_loop() is not asyncio.get_running_loop():
            fut = self._landed_fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
        return fut

    def forget_durable(self, tier_key: str) -> None:
        """The lowest tier lost ``tier_key`` (deleted, expired, evicted, corrupt): stop
        vouching for it, also when a write of it still in flight completes."""
        if tier_key.startswith(_C):
            key = tier_key[len(_C):]
            self._durable.pop(key, None)
            self._write_gen.pop(key, None)
            self._mark_unsaved(key)  # a later save writes it again even if held locally

    def _mark_unsaved(self, key: str) -> None:
        self._unsaved[key] = None
        if len(self._unsaved) > _DURABLE_MEMORY:
            self._unsaved.popitem(last=False)

    def _remember_durable_chunk(self, key: str, written_at: float | None = None) -> None:
        durable = self._durable
        durable[key] = time.time() if written_at is None else written_at
        durable.move_to_end(key)
        if len(durable) > _DURABLE_MEMORY:
            durable.popitem(last=False)

    async def get(self, key: str) -> Chunk | None:
        """The chunk under ``key`` or ``None`` (miss, unreachable or corrupt). See module doc."""
        if self.dram.has_local(_C + key):  # the common case, without the batch machinery
            hit = self.io.dram_get_decoded(self.dram, _C + key, _decode_trusted)
            if hit is not None:
                return hit[1]
        return (await self.find_chunk(key))[0]

    async def find_chunk(self, key: str) -> tuple[Chunk | None, str]:
        """``get`` plus the name of the tier it came from ("" on a miss)."""
        return (await self.find_chunks([key]))[0]

    async def find_chunks(
        self, keys: list[str], check: Callable[[Stored], Chunk] = decode_stored
    ) -> list[tuple[Chunk | None, str]]:
        """``find_chunk`` for many keys, one batched read per tier (a layer's chunks).

        ``check`` turns a lower tier's hit into the chunk where it is read (inline or on
        the reading thread): it must verify the checksum (raising ``ChunkCorrupt``) as
        ``decode_chunk`` does, and may act on the chunk there (the pool load reads it
        straight into its pool blocks). DRAM hits are decoded on the loop without it.
        """
        return [(chunk, tier) for _blob, chunk, tier in await self._find_many(keys, check)]

    async def get_blob(self, key: str) -> Blob | None:
        """The sealed blob under ``key`` (for sending to a peer) or ``None``."""
        blob, _chunk, _tier = (await self._find_many([key]))[0]
        if isinstance(blob, bytearray):
            await checksum_work(seal_chunk, blob)  # a put not yet written behind
        return blob

    async def _find_many(
        self, keys: list[str], check: Callable[[Stored], Chunk] = decode_stored
    ) -> list[tuple[Blob | None, Chunk | None, str]]:
        """(blob, chunk, tier name) per key, searching the tiers in order; ("" for a miss).
        DRAM hits are trusted and decoded without a checksum. A lower tier's hits are
        checked where they are read (``get_many_checked``); a corrupt one is deleted and
        the search goes on below; good ones are promoted if the check kept their blob
        (a check that read a chunk straight into place leaves none: blob None)."""
        out: list[tuple[Blob | None, Chunk | None, str]] = [(None, None, "")] * len(keys)
        todo: list[int] = []
        for j, key in enumerate(keys):
            hit = self.io.dram_get_decoded(self.dram, _C + key, _decode_trusted)
            if hit is not None:
                out[j] = (hit[0], hit[1], self.dram.name)
            else:
                todo.append(j)
        if not todo:
            return out
        reading = [_C + keys[j] for j in todo]
        for tk in reading:
            self._reading[tk] = self._reading.get(tk, 0) + 1
        try:
            await self._find_below(keys, todo, out, check)
        finally:
            for tk in reading:
                n = self._reading.pop(tk) - 1
                if n:
                    self._reading[tk] = n
                else:
                    self._changed_while_read.discard(tk)
        return out

    async def _find_below(self, keys: list[str], todo: list[int],
                          out: list[tuple[Blob | None, Chunk | None, str]],
                          check: Callable[[Stored], Chunk]) -> None:
        for i, tier in enumerate(self.tiers[1:], start=1):
            if not todo:
                break
            tkeys = [_C + keys[j] for j in todo]
            try:
                got = await self.io.get_many_checked(tier, tkeys, check)
            except ChunkCorrupt as e:  # the medium failed the batch: read one by one
                log.warning("%s reported corruption in a batch (%s); reading keys singly",
                            tier.name, e)
                got = [await self._get_one_checked(tier, k, check) for k in tkeys]
            missing = []
            for j, tkey, hit in zip(todo, tkeys, got, strict=True):
                if hit is None:
                    missing.append(j)
                    continue
                stored, chunk = hit
                if isinstance(chunk, ChunkCorrupt):
                    await self._drop_corrupt(tier, tkey, chunk, stored)
                    missing.append(j)
                    continue
                blob = stored.kept
                if blob is not None and tkey not in self._changed_while_read:
                    self._promote(tkey, blob, layer_priority(chunk.meta.layer), self.tiers[1:i])
                out[j] = (blob, chunk, tier.name)
            todo = missing

    async def _get_one_checked(
        self, tier: Tier, tkey: str, check: Callable[[Stored], Chunk]
    ) -> Checked[Chunk]:
        try:
            return (await self.io.get_many_checked(tier, [tkey], check))[0]
        except ChunkCorrupt as e:
            await self._drop_corrupt(tier, tkey, e)
            return None

    async def _drop_corrupt(self, tier: Tier, tkey: str, err: ChunkCorrupt,
                            found: Stored | None = None) -> None:
        log.warning("corrupt chunk %s in %s (%s): deleted, served as a miss", tkey, tier.name, err)
        self.metrics.checksum_failures.labels(tier.name).inc()
        if tier is self.lowest:
            self.forget_durable(tkey)  # (a newer copy is asked for again: conservative)
        try:
            if found is None:
                await tier.delete(tkey)
            else:  # only that copy: a newer one written since stays
                await tier.delete_copy(tkey, found)
        except TierUnavailable as e:
            log.warning("could not delete corrupt %s from %s: %s", tkey, tier.name, e)

    async def _undo_write(self, tier: Tier, tkey: str) -> None:
        """A write-behind put that landed after its chunk was deleted: delete it again."""
        if tier is self.lowest:
            self.forget_durable(tkey)
        await tier.delete(tkey)

    def _promote(self, tkey: str, blob: Blob, priority: int, upper: list[Tier]) -> None:
        self.io.dram_put(self.dram, tkey, blob, priority)
        if upper:  # e.g. an S3 hit is also copied to SSD, in the background
            self.writer.submit(tkey, blob, priority, upper, durable=False)

    def dram_blob(self, key: str) -> Blob | None:
        """The DRAM copy of chunk ``key`` (recency refreshed, no metrics: lookups)."""
        blob = self.dram.peek(_C + key)
        if blob is not None:
            self.dram.touch(_C + key)
        return blob

    def known_below_dram(self, key: str) -> Tier | None:
        """``first_tier_below_dram`` without I/O when the tier right below DRAM knows the
        key from its own index (the SSD's); None means "ask ``first_tier_below_dram``"."""
        if len(self.tiers) > 1 and self.tiers[1].has_local(_C + key):
            return self.tiers[1]
        return None

    async def first_tier_below_dram(self, key: str) -> Tier | None:
        """The fastest tier below DRAM holding chunk ``key`` (an unreachable tier is skipped)."""
        for tier in self.tiers[1:]:
            try:
                if await tier.contains(_C + key):
                    return tier
            except TierUnavailable:
                continue
        return None

    def pin(self, tier: Tier, key: str) -> None:
        """Protect chunk ``key`` from ``tier``'s eviction and expiry (a prefix lease)."""
        tier.pin(_C + key)

    def unpin(self, tier: Tier, key: str) -> None:
        tier.unpin(_C + key)

    def has_local_or_durable(self, key: str) -> bool:
        """Whether chunk ``key`` is known stored without remote I/O: in DRAM, being written
        behind, or in a local tier's index, or acknowledged durable by this process."""
        tkey = _C + key
        if key in self._unsaved:
            return False  # its durable write was dropped: it must be written again
        if key in self._inflight or key in self._durable:
            return True
        return self._held_locally(tkey) or self.lowest.has_local(tkey)

    def _held_locally(self, tkey: str) -> bool:
        """In DRAM or a local tier above the lowest (no I/O)."""
        return self.dram.peek(tkey) is not None or any(
            t.has_local(tkey) for t in self.tiers[1:-1])

    async def locate(self, key: str) -> list[str]:
        """Names of the tiers holding ``key`` (an unreachable tier is left out)."""
        out = []
        for tier in self.tiers:
            try:
                if await tier.contains(_C + key):
                    out.append(tier.name)
            except TierUnavailable:
                continue
        return out

    async def delete(self, key: str, tiers: Collection[str] = ()) -> int:
        """Delete ``key`` from ``tiers`` (names; empty = every tier); how many held it."""
        return await self._delete_from(_C + key, tiers)

    def check_tier_names(self, names: Collection[str]) -> None:
        """Raise ``ValueError`` naming the known tiers if any name is not one of them."""
        known = [t.name for t in self.tiers]
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"unknown tier(s) {bad}; this kvstore has {known}")

    async def _delete_from(self, tkey: str, names: Collection[str]) -> int:
        if tkey in self._reading:
            self._changed_while_read.add(tkey)
        if not names or self.lowest.name in names:
            self.forget_durable(tkey)
            self.writer.forget(tkey)  # a queued write would bring it back
        n = 0
        for tier in self.tiers:
            if names and tier.name not in names:
                continue
            try:
                n += bool(await tier.delete(tkey))
            except TierUnavailable as e:
                log.warning("delete of %s in %s failed: %s", tkey, tier.name, e)
        return n

    async def is_durable(self, key: str) -> bool:
        """Whether ``key`` is in the lowest tier, waiting for an in-flight write first."""
        fut = self._inflight.get(key)
        if fut is not None:
            try:
                await asyncio.shield(fut)
            except WriteDropped:
                return False
        # An ack vouches only if nothing deleted the chunk while it was written (its
        # ``_written`` callback, which ran before ours, decided that).
        return bool(await self._durable_for_a_ttl(key))

    async def _durable_for_a_ttl(self, key: str) -> bool | None:
        """Whether chunk ``key`` is in the lowest tier with at least half its TTL to go.

        A manifest is rewritten every turn but names chunks of every earlier turn; the
        lowest tier expires each chunk by its own age. So a chunk older than half the
        TTL is refreshed (its clock restarted) before a manifest may name it: a session in
        use never has its early chunks expire under a manifest (Symphony §3.4: the
        slowest tier holds the complete copy). What the store wrote itself recently is
        trusted without asking. None: unknown (the lowest tier did not answer)."""
        tkey = _C + key
        if tkey in self.sweeping:
            return False
        now = time.time()
        at = self._durable.get(key)
        if at is not None and now - at < self.ttl_s / 2:
            return True
        try:
            at = await self.lowest.written_at(tkey)
            if at is not None and now - at >= self.ttl_s / 2:
                at = now if await self.lowest.refresh(tkey) else None
        except TierUnavailable:
            return None
        if at is None:
            self.forget_durable(tkey)
            return False
        if tkey in self.sweeping:  # the sweep started on it while we asked: it may delete it
            return False
        self._remember_durable_chunk(key, at)
        return True

    # ---------------------------------------------------------------- sessions

    async def get_layer(self, manifest: Manifest, layer: int) -> list[Chunk | None]:
        """The chunks of one layer of a session, in token order (``None`` = miss)."""
        return list(await asyncio.gather(*(self.get(k) for k in manifest.layer_keys(layer))))

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
        settled = [k for k in keys if k not in self._inflight]
        # In batches, stopping at the first batch with a chunk that cannot be had: a
        # manifest naming many chunks this store never saw costs one batch of checks.
        for i in range(0, len(settled), DURABLE_CHECK_BATCH):
            await self._settle(manifest, settled[i : i + DURABLE_CHECK_BATCH])
        pending = {k: self._inflight[k] for k in keys if k in self._inflight}
        if pending:
            await asyncio.wait([asyncio.shield(f) for f in pending.values()], timeout=wait_s)
            late = sum(1 for f in pending.values() if not f.done())
            if late:
                raise ManifestIncomplete(
                    f"manifest {manifest.key}: {late} chunks still not durable after {wait_s}s")
            # A completed write vouches only if nothing deleted its chunk meanwhile.
            for k in pending:
                if k not in self._durable and not await self._durable_for_a_ttl(k):
                    raise ManifestIncomplete(
                        f"manifest {manifest.key}: chunk {k} was lost while written")

    async def _settle(self, manifest: Manifest, keys: list[str]) -> None:
        """Chunks ``keys`` (none in flight) durable, or written down again from a local
        copy (in flight then); else ``ManifestIncomplete``."""
        known = dict(zip(keys, await asyncio.gather(*(self._durable_for_a_ttl(k) for k in keys))))
        unknown = [k for k, ok in known.items() if ok is None]
        if unknown and self.lowest.stats().healthy:
            # Refused by a tier that was degraded, and has answered since (its first check
            # was the probe that healed it): ask once more.
            known.update(zip(unknown, await asyncio.gather(
                *(self._durable_for_a_ttl(k) for k in unknown))))
            unknown = [k for k in unknown if known[k] is None]
        if unknown:  # not known absent: nothing to write again, but not known durable
            raise ManifestIncomplete(
                f"manifest {manifest.key}: {self.lowest.name} did not answer for "
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
        if self.lowest is self.dram or not self.lowest.stats().healthy:
            return keys
        lost = []
        for key in keys:
            tkey = _C + key
            blob = self.dram.peek(tkey)
            for tier in self.tiers[1:-1]:
                if blob is not None:
                    break
                try:
                    blob = await self.io.get(tier, tkey)
                    if blob is not None:
                        await checksum_work(verify_chunk, blob)
                except TierUnavailable:
                    blob = None
                except ChunkCorrupt as e:
                    await self._drop_corrupt(tier, tkey, e)
                    blob = None
            if key in self._inflight:
                continue  # a put of it started meanwhile: its write covers it
            if blob is None or not self._held_locally(tkey):
                lost.append(key)  # (deleted while we read it: not to be brought back)
                continue
            log.info("chunk %s is held here but not in %s: writing it again", key, self.lowest.name)
            self._write_behind(key, blob, layer_priority(int(key.rsplit("/", 1)[1])),
                               [self.lowest])
        return lost

    async def write_manifest(self, manifest: Manifest) -> None:
        """Write ``manifest`` to the lowest tier, then the local ones (``put_manifest``
        without the durability check: only after ``wait_durable``)."""
        blob = manifest.encode()
        tkey = _M + manifest.key
        # Lowest tier first: it is the authority; the SSD copy only speeds up local reads.
        await self.io.put(self.lowest, tkey, blob, MANIFEST_PRIORITY)
        for tier in self.tiers[1:-1]:
            try:
                await self.io.put(tier, tkey, blob, MANIFEST_PRIORITY)
            except TierUnavailable as e:
                log.warning("local manifest copy of %s failed: %s", manifest.key, e)

    async def get_manifest(self, tenant: str, session_id: str) -> Manifest | None:
        """The session's manifest from the lowest reachable tier below DRAM, or ``None``."""
        tkey = _M + manifest_key(tenant, session_id)
        for tier in reversed(self.tiers[1:] or self.tiers):
            try:
                blob = await tier.get(tkey)
            except TierUnavailable:
                continue
            if blob is not None:
                try:
                    return Manifest.decode(blob)
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("unreadable manifest %s in %s: %s", tkey, tier.name, e)
                    try:
                        await tier.delete(tkey)
                    except TierUnavailable as err:  # it stays unreadable: still a miss
                        log.warning("could not delete %s from %s: %s", tkey, tier.name, err)
        return None

    async def delete_manifest(
        self, tenant: str, session_id: str, tiers: Collection[str] = ()
    ) -> int:
        return await self._delete_from(_M + manifest_key(tenant, session_id), tiers)

    # ---------------------------------------------------------------- expiry

    async def sweep(self, now: float | None = None) -> int:
        """One expiry pass (see ``sweeper.sweep_tiers``); entries removed."""
        return await sweep_tiers(self, time.time() if now is None else now)

    # ---------------------------------------------------------------- status

    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def health(self) -> tuple[bool, str]:
        """(healthy, detail): unhealthy tiers named, e.g. ``s3 degraded: ...``."""
        problems = [f"{s.name} degraded: {s.detail}" for s in self.stats() if not s.healthy]
        recent = self.writer.recent_drops()
        if recent:  # the lifetime count is in Status.dropped_writes and the metrics
            problems.append(f"{recent} write-behind jobs dropped in the last "
                            f"{RECENT_DROPS_S / 60:g} min")
        return (not any(not s.healthy for s in self.stats()), "; ".join(problems) or "ok")

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
        self.writer.check_integrity()
        assert all(not f.done() for f in self._inflight.values()), "finished write still in flight"
