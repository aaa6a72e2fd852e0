"""SSD tier: RocksDB through rocksdict, WAL on, bounded by a byte capacity.

Layout in the default column family (one atomic WriteBatch per put)::

    b"v:" + key -> blob
    b"m:" + key -> msgpack [size, priority, touched]   (rebuilt into memory at open)

With ``sync=False`` a write is in the WAL in the OS page cache when ``put`` returns: it
survives a ``kill -9`` of the process but not a power cut; ``sync=True`` fsyncs the WAL.
All RocksDB calls run on the tier's own small thread pool, never on the event loop.

Reads skip two things RocksDB would do by default, because the layer above does them:
- block checksums: every chunk carries its own checksum, which the store verifies on
  every SSD hit (a flipped byte is caught either way; verifying twice cost ~1/3 of a
  1 MiB read here);
- filling the block cache: the store promotes every hit into its DRAM tier, the cache
  above this one. Caching 1 MiB values again in RocksDB evicts the index and filter
  blocks and copies each value once more (the OS page cache still serves re-reads).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
from rocksdict import (
    BlockBasedOptions,
    Cache,
    DBCompressionType,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from services.kvstore.errors import ChunkCorrupt, TierOpenError, TierUnavailable
from services.kvstore.tiers.base import Blob, Checked, T, Tier, TierStats, apply_check
from services.kvstore.tiers.lru_index import PriorityLru

log = logging.getLogger(__name__)

_V = b"v:"
_M = b"m:"


class SsdTier(Tier):
    name = "ssd"

    def __init__(
        self, path: str, capacity_bytes: int, sync: bool = False, threads: int = 2,
        cache_bytes: int = 256 << 20,
    ) -> None:
        self.path = path
        self.sync = sync
        self.cache_bytes = cache_bytes
        self._threads = threads
        self._index = PriorityLru(capacity_bytes)
        self._db: Rdict | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._write_lock = asyncio.Lock()
        self._error = ""

    # ---------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kv-ssd")
        try:
            self._db, entries = await self._run(self._open_blocking)
        except TierOpenError:
            self._pool.shutdown(wait=False)
            self._pool = None
            raise
        for key, (size, prio, touched) in entries.items():
            self._index.add(key, size, prio, touched)
        log.info(
            "ssd tier open at %s: %d entries, %d bytes",
            self.path,
            len(entries),
            self._index.bytes_used,
        )

    def _open_blocking(self) -> tuple[Rdict, dict[str, tuple[int, int, float]]]:
        hint = "(is another kvstore using this path? is the disk writable and not full?)"
        try:
            Path(self.path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierOpenError(
                f"kvstore.ssd_path: cannot create {self.path!r}: {e.strerror} {hint}"
            ) from None
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        # KV tensors are high-entropy floats: compression costs CPU on every read and write
        # for almost no space. The block cache holds index and filter blocks (data reads
        # do not fill it, see the module docstring).
        opts.set_compression_type(DBCompressionType.none())
        table = BlockBasedOptions()
        table.set_block_cache(Cache(self.cache_bytes))
        opts.set_block_based_table_factory(table)
        try:
            db = Rdict(self.path, opts)
        except Exception as e:  # rocksdict raises a bare Exception for IO errors
            raise TierOpenError(
                f"kvstore.ssd_path: cannot open RocksDB at {self.path!r}: {e} {hint}"
            ) from None
        wo = WriteOptions()
        wo.sync = self.sync
        wo.disable_wal = False
        db.set_write_options(wo)
        ro = ReadOptions()
        ro.set_verify_checksums(False)
        ro.fill_cache(False)
        db.set_read_options(ro)
        entries: dict[str, tuple[int, int, float]] = {}
        it = db.iter()
        it.seek(_M)
        while it.valid() and it.key().startswith(_M):
            size, prio, touched = msgpack.unpackb(it.value())
            entries[it.key()[2:].decode()] = (int(size), int(prio), float(touched))
            it.next()
        del it  # an iterator pins the DB; drop it so close() releases the lock
        return db, entries

    async def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            await self._run(db.close)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            raise TierUnavailable("ssd tier is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _live_db(self) -> Rdict:
        if self._db is None:
            raise TierUnavailable("ssd tier is closed")
        return self._db

    # ---------------------------------------------------------------- operations

    async def get(self, key: str) -> Blob | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: list[str]) -> list[Blob | None]:
        """One thread hop for the whole batch (a hop costs ~0.2 ms on a busy VM, more than
        reading 1 MiB from the page cache). A key the index does not know is a miss
        without I/O; a medium error fails the batch."""
        return await self._read_batch(keys, _read_all)

    async def get_many_checked(
        self, keys: list[str], check: Callable[[Blob], T]
    ) -> list[Checked[T]]:
        """``get_many`` with ``check`` run on the reading thread, right after each read:
        verifying a chunk there hashes bytes that are still in cache (on the event loop,
        after the batch, it ran at memory speed, ~4x slower here) and leaves the loop free."""
        return await self._read_batch(keys, functools.partial(_read_all_checked, check=check))

    async def _read_batch(self, keys: list[str], read: Callable[[Rdict, list[bytes]], list[Any]]
                          ) -> list[Any]:
        db = self._live_db()
        want = [k for k in keys if k in self._index]
        if not want:
            return [None] * len(keys)
        try:
            blobs = await self._run(read, db, [_V + k.encode() for k in want])
        except TierUnavailable:
            raise
        except Exception as e:
            if "Corruption" in str(e):  # the medium (RocksDB metadata) reports corruption
                raise ChunkCorrupt(f"ssd: {e}") from None
            raise TierUnavailable(f"ssd read failed: {e}") from None
        found = dict(zip(want, blobs, strict=True))
        now = time.time()
        out: list[Blob | None] = []
        for k in keys:
            blob = found.get(k)
            if blob is not None:
                self._index.touch(k, now)
            out.append(blob)
        return out

    async def put(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        db = self._live_db()
        async with self._write_lock:
            old = self._index.get(key)
            free_again = old.size if old else 0
            if len(blob) > self._index.capacity_bytes:
                return [key]
            victims = [k for k in self._index.victims(len(blob) - free_again) if k != key]
            if not self._index.fits(len(blob), victims, free_again):
                # Leased (pinned) chunks fill the tier: transient, the write-behind retries
                # after the leases end.
                raise TierUnavailable("ssd full: the remaining chunks are leased")
            now = time.time()
            batch = WriteBatch(raw_mode=True)
            for k in victims:
                batch.delete(_V + k.encode())
                batch.delete(_M + k.encode())
            kb = key.encode()
            batch.put(_V + kb, bytes(blob) if isinstance(blob, bytearray) else blob)
            batch.put(_M + kb, msgpack.packb([len(blob), priority, now]))
            try:
                await self._run(db.write, batch)
            except TierUnavailable:
                raise
            except Exception as e:  # disk full, I/O error
                self._error = f"ssd write failed: {e}"
                log.error("%s", self._error)
                raise TierUnavailable(self._error) from None
            self._error = ""
            for k in victims:
                self._index.remove(k)
            self._index.add(key, len(blob), priority, now)
            return victims

    async def contains(self, key: str) -> bool:
        return key in self._index

    async def delete(self, key: str) -> bool:
        db = self._live_db()
        if self._index.remove(key) is None:
            return False
        batch = WriteBatch(raw_mode=True)
        batch.delete(_V + key.encode())
        batch.delete(_M + key.encode())
        try:
            await self._run(db.write, batch)
        except Exception as e:
            raise TierUnavailable(f"ssd delete failed: {e}") from None
        return True

    async def scan_expired(self, older_than: float) -> list[str]:
        return self._index.older_than(older_than)

    def has_local(self, key: str) -> bool:
        return key in self._index

    def pin(self, key: str) -> None:
        self._index.pin(key)

    def unpin(self, key: str) -> None:
        self._index.unpin(key)

    async def raw_put(self, key: str, blob: bytes) -> None:
        """Overwrite the stored bytes of ``key`` without bookkeeping (fault-injection tests)."""
        await self._run(self._live_db().put, _V + key.encode(), blob)

    def stats(self) -> TierStats:
        healthy = self._db is not None and not self._error
        return TierStats(
            self.name,
            len(self._index),
            self._index.bytes_used,
            self._index.capacity_bytes,
            healthy,
            self._error or ("" if self._db is not None else "closed"),
        )

    def check_integrity(self) -> None:
        self._index.check_integrity()
        assert self._index.bytes_used <= self._index.capacity_bytes, "over capacity"


def _read_all(db: Rdict, keys: list[bytes]) -> list[bytes | None]:
    # Point gets, not RocksDB's multi_get: through rocksdict the latter measured ~8x slower
    # for chunk-sized values here.
    return [db.get(k) for k in keys]


def _read_all_checked(db: Rdict, keys: list[bytes], check: Callable[[Blob], T]) -> list[Checked[T]]:
    return [apply_check(db.get(k), check) for k in keys]
