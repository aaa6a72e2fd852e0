"""Opening the SSD tier: RocksDB with its options, and the catalog of what is stored.

The catalog is rebuilt from RocksDB's ``m:`` entries at open; damaged entries are dropped
(their chunks are misses), and blob files no entry names (written or dropped around a
crash) are deleted. A put survives a ``kill -9`` without ``sync`` (both writes are in the
page cache); a power cut may tear a file, which the chunk checksum catches.

RocksDB reads skip block checksums (every chunk carries its own, verified on every SSD
hit) and do not fill the block cache, which holds the index and filter blocks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

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

from services.kvstore.errors import TierOpenError

log = logging.getLogger(__name__)

VALUE_PREFIX = b"v:"
META_PREFIX = b"m:"
Entries = dict[str, tuple[int, int, float, int | None]]  # key -> size, prio, touched, file


def open_catalog(
    path: str, blob_dir: str, cache_bytes: int, sync: bool
) -> tuple[Rdict, Entries, int, int]:
    """(db, entries, orphan files removed, the blob directory's fd). Raises
    ``TierOpenError`` naming the path and what to check."""
    hint = "(is another kvstore using this path? is the disk writable and not full?)"
    try:
        Path(blob_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        # Tenants' KV: only this service's user may list or read it (RocksDB's own files
        # are made under the kvstore's umask, 077).
        os.chmod(path, 0o700)
        os.chmod(blob_dir, 0o700)
    except OSError as e:
        raise TierOpenError(
            f"kvstore.ssd_path: cannot create {path!r}: {e.strerror} {hint}"
        ) from None
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    # The catalog's values are small, and chunks are high-entropy floats besides:
    # compression would cost CPU on every read and write for almost no space.
    opts.set_compression_type(DBCompressionType.none())
    table = BlockBasedOptions()
    table.set_block_cache(Cache(cache_bytes))
    opts.set_block_based_table_factory(table)
    try:
        db = Rdict(path, opts)
    except Exception as e:  # rocksdict raises a bare Exception for IO errors
        raise TierOpenError(
            f"kvstore.ssd_path: cannot open RocksDB at {path!r}: {e} {hint}"
        ) from None
    try:
        return _load_catalog(db, path, blob_dir, sync)
    except BaseException as e:
        db.close()  # releases RocksDB's lock: the path can be opened again
        if isinstance(e, Exception) and not isinstance(e, TierOpenError):
            raise TierOpenError(
                f"kvstore.ssd_path: cannot read the catalog at {path!r}: {e} {hint}"
            ) from None
        raise


def _load_catalog(
    db: Rdict, path: str, blob_dir: str, sync: bool
) -> tuple[Rdict, Entries, int, int]:
    wo = WriteOptions()
    # (rocksdict's stubs declare these properties as methods)
    wo.sync = sync
    wo.disable_wal = False  # type: ignore[method-assign,assignment]
    db.set_write_options(wo)
    ro = ReadOptions()
    ro.set_verify_checksums(False)
    ro.fill_cache(False)  # type: ignore[call-arg]
    db.set_read_options(ro)
    entries: Entries = {}
    unreadable: list[bytes] = []
    it = db.iter()
    try:
        it.seek(META_PREFIX)
        while it.valid() and it.key().startswith(META_PREFIX):
            try:
                size, prio, touched, *file_no = msgpack.unpackb(it.value())
                entries[it.key()[2:].decode()] = (
                    int(size), int(prio), float(touched),
                    int(file_no[0]) if file_no else None)
            except (ValueError, TypeError, UnicodeDecodeError, msgpack.UnpackException):
                unreadable.append(it.key())  # a damaged entry: its chunk is a miss
            it.next()
    finally:
        del it  # an iterator pins the DB; drop it so close() can release the lock
    if unreadable:
        log.warning("ssd tier at %s: dropping %d unreadable catalog entries",
                    path, len(unreadable))
        batch = WriteBatch(raw_mode=True)
        for k in unreadable:
            batch.delete(k)
            batch.delete(VALUE_PREFIX + k[len(META_PREFIX):])
        db.write(batch)
    live = {f"{e[3]:016x}" for e in entries.values() if e[3] is not None}
    orphans = 0
    for name in os.listdir(blob_dir):
        if name not in live:  # written or dropped around a crash: no entry names it
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(blob_dir, name))
                orphans += 1
    dir_fd = os.open(blob_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if sync:  # the blobs directory's own entry, in case it was just created
            parent = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(parent)
            finally:
                os.close(parent)
    except BaseException:
        os.close(dir_fd)
        raise
    return db, entries, orphans, dir_fd
