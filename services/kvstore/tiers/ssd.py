"""SSD tier: RocksDB through rocksdict (the catalog, WAL on) and one file per large blob.

Layout (one atomic RocksDB WriteBatch per put)::

    <path>/                    RocksDB
        b"m:" + key -> msgpack [size, priority, touched(, file number)]  (rebuilt at open)
        b"v:" + key -> blob     only blobs of at most ``inline_max_bytes`` (manifests)
    <path>/blobs/<file number> every larger blob (chunks), written before its catalog entry

Chunks live beside RocksDB, not in it (key-value separation, as WiscKey and BlobDB do):
a file is read with ``preadv`` straight to where it is going (``ssd_files``), the
engine's pool blocks when a session is loaded, inline on the event loop when the page
cache holds it (``RWF_NOWAIT``). Crash safety: a blob's file is complete before the entry
naming it is written, and dropped files are unlinked only after the entry that drops
them; with ``sync=True`` the file, its directory and the WAL are fsynced. Files no entry
names are deleted at open (``ssd_catalog``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
from rocksdict import (
    Rdict,
    WriteBatch,
)

from services.kvstore.errors import ChunkCorrupt, TierUnavailable
from services.kvstore.tiers.base import (
    Blob,
    Checked,
    Stored,
    T,
    Tier,
    TierStats,
    apply_check,
    whole_blob,
)
from services.kvstore.tiers.lru_index import IndexedTtl, PriorityLru
from services.kvstore.tiers.ssd_catalog import META_PREFIX, VALUE_PREFIX, open_catalog
from services.kvstore.tiers.ssd_files import (
    FileStored,
    Missing,
    NoWaitUnsupported,
    WouldBlock,
    read_blocking,
    write_blocking,
)

log = logging.getLogger(__name__)

# No access-time update on reads: with relatime the first read of a new file would write
# its inode, a journalled write RWF_NOWAIT does not cover, on the event loop.
_O_NOATIME = getattr(os, "O_NOATIME", 0)
_BLOBS = "blobs"


class SsdTier(IndexedTtl, Tier):
    name = "ssd"

    def __init__(
        self, path: str, capacity_bytes: int, sync: bool = False, threads: int = 2,
        cache_bytes: int = 256 << 20, inline_max_bytes: int = 4096,
    ) -> None:
        self.path = path
        self.sync = sync
        self.cache_bytes = cache_bytes
        self.inline_max_bytes = inline_max_bytes
        self._threads = threads
        self._index = PriorityLru(capacity_bytes)
        self._files: dict[str, int] = {}  # key -> file number, for blobs kept in files
        self._next_file = 0
        self._blob_dir = os.path.join(path, _BLOBS)
        self._dir_fd = -1
        self._nowait = hasattr(os, "RWF_NOWAIT")
        self._read_flags = os.O_RDONLY | os.O_CLOEXEC | _O_NOATIME
        self._db: Rdict | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._write_lock = asyncio.Lock()
        self._error = ""

    # ---------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="kv-ssd")
        try:
            self._db, entries, orphans, self._dir_fd = await self._run(
                open_catalog, self.path, self._blob_dir, self.cache_bytes, self.sync)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise
        for key, (size, prio, touched, file_no) in entries.items():
            self._index.add(key, size, prio, touched)
            if file_no is not None:
                self._files[key] = file_no
        self._next_file = max(self._files.values(), default=-1) + 1
        log.info(
            "ssd tier open at %s: %d entries, %d bytes (%d in files; %d orphan files removed)",
            self.path, len(entries), self._index.bytes_used, len(self._files), orphans,
        )

    async def close(self) -> None:
        async with self._write_lock:  # a write under way finishes first (RocksDB would
            db, self._db = self._db, None  # refuse the close while it holds the DB)
        if db is not None:
            await self._run(db.close)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            raise TierUnavailable("ssd tier is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run_settled(self, fn: Any, *args: Any) -> bool:
        """``_run`` for writes: if the caller is cancelled meanwhile, wait for the thread
        anyway (it cannot be stopped) so that the index is updated to match the disk before
        the write lock is released. True if the caller was cancelled (raise it after that
        update); ``fn``'s own error is raised, or the cancellation if there was one."""
        fut = asyncio.ensure_future(self._run(fn, *args))
        cancelled = False
        while True:
            try:
                await asyncio.shield(fut)
                return cancelled
            except asyncio.CancelledError:
                if fut.cancelled():  # the thread's future itself (executor shut down)
                    raise
                cancelled = True
            except BaseException:
                if cancelled:
                    raise asyncio.CancelledError from None
                raise

    def _live_db(self) -> Rdict:
        if self._db is None:
            raise TierUnavailable("ssd tier is closed")
        return self._db

    def _file(self, file_no: int) -> str:
        return os.path.join(self._blob_dir, f"{file_no:016x}")

    # ---------------------------------------------------------------- reads

    async def get(self, key: str) -> Blob | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: list[str]) -> list[Blob | None]:
        """The blobs, in order; an indexed blob whose file is gone is dropped and missed."""
        got = await self._read_batch(keys, whole_blob)
        out: list[Blob | None] = []
        for k, hit in zip(keys, got, strict=True):
            value = None if hit is None else hit[1]
            if isinstance(value, ChunkCorrupt):
                await self.delete(k)
                value = None
            out.append(value)
        return out

    async def get_many_checked(
        self, keys: list[str], check: Callable[[Stored], T]
    ) -> list[Checked[T]]:
        """``check`` runs right where each hit is read: inline for page-cache hits, else on
        the reading thread, while the bytes are still in the CPU's cache and off the loop.
        A file-backed hit reaches ``check`` unread (``FileStored``)."""
        return await self._read_batch(keys, check)

    async def _read_batch(self, keys: list[str], check: Callable[[Stored], T]
                          ) -> list[Checked[T]]:
        db = self._live_db()
        out: list[Checked[T] | Missing] = [None] * len(keys)
        later: list[tuple[int, str, int | None]] = []  # read on a thread: one hop in all
        for j, k in enumerate(keys):
            if k not in self._index:
                continue  # a miss without I/O
            file_no = self._files.get(k)
            if file_no is not None and self._nowait:
                try:
                    out[j] = self._read_file(k, file_no, check, nowait=True)
                    continue
                except WouldBlock:
                    pass
                except NoWaitUnsupported:
                    log.info("ssd: %s does not take RWF_NOWAIT; reading on threads", self.path)
                    self._nowait = False
                except OSError as e:
                    raise TierUnavailable(f"ssd read failed: {e}") from None
            later.append((j, k, file_no))
        if later:
            try:
                got = await self._run(read_blocking, self._read_file, db, later, check)
            except TierUnavailable:
                raise
            except Exception as e:
                if "Corruption" in str(e):  # the medium (RocksDB metadata) reports corruption
                    raise ChunkCorrupt(f"ssd: {e}") from None
                raise TierUnavailable(f"ssd read failed: {e}") from None
            for (j, _k, _no), hit in zip(later, got, strict=True):
                out[j] = hit
        now = time.time()
        result: list[Checked[T]] = []
        for k, hit in zip(keys, out, strict=True):
            if isinstance(hit, Missing):
                hit = await self._missing(k, hit.file_no, check)
            if hit is not None:
                self._index.touch(k, now)
            result.append(hit)
        return result

    def _read_file(self, key: str, file_no: int, check: Callable[[Stored], T], nowait: bool
                   ) -> Checked[T] | Missing:
        path = self._file(file_no)
        try:
            try:
                fd = os.open(path, self._read_flags)
            except PermissionError:  # O_NOATIME on a file of another user: read it anyway
                self._read_flags &= ~_O_NOATIME
                fd = os.open(path, self._read_flags)
        except FileNotFoundError:
            return Missing(file_no)
        stored = None
        try:
            stored = FileStored(fd, os.fstat(fd).st_size, nowait, file_no)
            return apply_check(stored, check, key)
        finally:
            if stored is not None:
                stored.closed()
            os.close(fd)

    async def _missing(self, key: str, file_no: int, check: Callable[[Stored], T]
                       ) -> Checked[T]:
        """A file gone under its entry: a put replaced it while it was read (read the new
        one), a delete or eviction dropped it (a miss), or it was lost (corruption: the
        caller drops the entry). Writes hold the lock until the index agrees with the
        disk, so wait for it before telling."""
        async with self._write_lock:
            now_no = self._files.get(key)
            if now_no == file_no:
                return Stored(b""), ChunkCorrupt(f"ssd: the file of {key} is missing")
        if now_no is None or key not in self._index:
            return None
        got = await self._run(self._read_file, key, now_no, check, False)
        return None if isinstance(got, Missing) else got

    # ---------------------------------------------------------------- writes

    async def put(self, key: str, blob: Blob, priority: int = 0) -> list[str]:
        async with self._write_lock:
            db = self._live_db()  # under the lock: close() takes it too
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
            file_no: int | None = None
            if len(blob) > self.inline_max_bytes:
                file_no, self._next_file = self._next_file, self._next_file + 1
            batch = WriteBatch(raw_mode=True)
            for k in victims:
                batch.delete(VALUE_PREFIX + k.encode())
                batch.delete(META_PREFIX + k.encode())
            kb = key.encode()
            if file_no is None:
                batch.put(VALUE_PREFIX + kb, bytes(blob) if isinstance(blob, bytearray) else blob)
                batch.put(META_PREFIX + kb, msgpack.packb([len(blob), priority, now]))
            else:
                batch.delete(VALUE_PREFIX + kb)
                batch.put(META_PREFIX + kb, msgpack.packb([len(blob), priority, now, file_no]))
            dropped = [self._files[k] for k in [*victims, key] if k in self._files]
            try:
                cancelled = await self._write(db, batch, file_no, blob, dropped)
            except (TierUnavailable, asyncio.CancelledError):
                raise
            except Exception as e:  # disk full, I/O error
                self._error = f"ssd write failed: {e}"
                log.error("%s", self._error)
                raise TierUnavailable(self._error) from None
            self._error = ""
            for k in victims:
                self._index.remove(k)
                self._files.pop(k, None)
            self._index.add(key, len(blob), priority, now)
            if file_no is None:
                self._files.pop(key, None)
            else:
                self._files[key] = file_no
            if cancelled:  # the write is done and accounted: now the caller may stop
                raise asyncio.CancelledError
            return victims

    async def _write(self, db: Rdict, batch: WriteBatch, file_no: int | None, blob: Blob,
                     dropped: list[int]) -> bool:
        """The blob's file (if ``file_no``), the catalog batch, then the dropped files, on
        a thread, settled (see ``_run_settled``; ``write_blocking``)."""
        return await self._run_settled(
            write_blocking, db, batch, None if file_no is None else self._file(file_no),
            blob, [self._file(no) for no in dropped], self.sync, self._dir_fd)

    async def contains(self, key: str) -> bool:
        return key in self._index

    async def delete(self, key: str) -> bool:
        return await self._delete(key, None)

    async def delete_copy(self, key: str, found: Stored) -> bool:
        file_no = found.file_no if isinstance(found, FileStored) else None
        return await self._delete(key, file_no)

    async def _delete(self, key: str, only_file: int | None) -> bool:
        async with self._write_lock:
            db = self._live_db()
            if only_file is not None and self._files.get(key) != only_file:
                return False  # replaced since that copy was read: the new one stays
            if self._index.remove(key) is None:
                return False
            file_no = self._files.pop(key, None)
            batch = WriteBatch(raw_mode=True)
            batch.delete(VALUE_PREFIX + key.encode())
            batch.delete(META_PREFIX + key.encode())
            try:
                cancelled = await self._write(db, batch, None, b"",
                                              [] if file_no is None else [file_no])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise TierUnavailable(f"ssd delete failed: {e}") from None
            if cancelled:
                raise asyncio.CancelledError
            return True

    async def scan_expired(self, older_than: float) -> list[str]:
        return self._index.older_than(older_than)

    def has_local(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        return self._index.keys()

    def pin(self, key: str) -> None:
        self._index.pin(key)

    def unpin(self, key: str) -> None:
        self._index.unpin(key)

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
        assert all(k in self._index for k in self._files), "a file outside the index"
