"""The SSD tier's blob files: a stored blob read on demand with ``preadv``, straight into
the caller's buffers (a pool load reads a chunk into its pool blocks), inline on the event
loop when the page cache holds it (``RWF_NOWAIT``) and on the tier's threads otherwise;
written in the order that survives a crash (``write_blocking``): the file complete, then
the catalog entry naming it, then the files no entry names any more.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable

from rocksdict import Rdict, WriteBatch

from services.kvstore.errors import ChunkCorrupt
from services.kvstore.tiers.base import Blob, Checked, Stored, T, apply_check
from services.kvstore.tiers.ssd_catalog import VALUE_PREFIX


class WouldBlock(Exception):
    """An inline read needs the device (``RWF_NOWAIT`` refused): retry it on a thread."""


class NoWaitUnsupported(Exception):
    """The file system does not take ``RWF_NOWAIT``: read on threads from now on."""


class Missing:
    """An indexed blob whose file is gone (``file_no`` is the one that was looked for)."""

    def __init__(self, file_no: int) -> None:
        self.file_no = file_no


class FileStored(Stored):
    """A blob in one of the tier's files, read on demand (see ``Stored``).

    ``nowait``: every read is ``RWF_NOWAIT`` and raises ``WouldBlock`` where the page
    cache does not hold the bytes, so the event loop never waits for the device."""

    def __init__(self, fd: int, nbytes: int, nowait: bool, file_no: int = -1) -> None:
        self._blob = None
        self.file_no = file_no  # which of the tier's files this is
        self.nbytes = nbytes
        self._fd = fd
        self._flags = os.RWF_NOWAIT if nowait else 0

    def read(self, offset: int, n: int) -> Blob | memoryview:
        if self._blob is not None:
            return memoryview(self._blob)[offset : offset + n]
        buf = bytearray(max(0, min(n, self.nbytes - offset)))
        self.readinto(offset, [memoryview(buf)])
        return buf

    def readinto(self, offset: int, bufs: list[memoryview]) -> None:
        if self._blob is not None:
            return super().readinto(offset, bufs)
        if self._fd < 0:  # the number may belong to another file by now
            raise RuntimeError("FileStored read after its file was closed")
        want = sum(len(b) for b in bufs)
        if offset + want > self.nbytes:
            raise ChunkCorrupt(f"ssd: blob of {self.nbytes} bytes ends before byte "
                               f"{offset + want}")
        while bufs:
            try:
                got = os.preadv(self._fd, bufs, offset, self._flags)
            except BlockingIOError:
                raise WouldBlock from None
            except OSError as e:
                if self._flags and e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise NoWaitUnsupported from None
                raise
            if got == want:
                return
            if self._flags:  # partly cached, or the file shrank: the blocking read tells
                raise WouldBlock
            if got == 0:
                raise ChunkCorrupt(f"ssd: blob file ends at byte {offset} of {self.nbytes}")
            offset, want, bufs = offset + got, want - got, skip(bufs, got)

    def closed(self) -> None:
        """The tier closed the file: any later read is a bug, not a read of another file."""
        self._fd = -1


def skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes (after a short read)."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out


ReadFile = Callable[[str, int, Callable[[Stored], T], bool], "Checked[T] | Missing"]


def read_blocking(read_file: ReadFile[T], db: Rdict, items: list[tuple[int, str, int | None]],
                  check: Callable[[Stored], T]) -> list[Checked[T] | Missing]:
    """(on the tier's thread) The reads the loop left to a thread: catalog values by point
    gets (rocksdict's multi_get is slower for chunk-sized values), files with blocking
    reads (``read_file(key, file_no, check, nowait=False)``)."""
    out: list[Checked[T] | Missing] = []
    for _j, key, file_no in items:
        if file_no is None:
            out.append(apply_check(db.get(VALUE_PREFIX + key.encode()), check, key))
        else:
            out.append(read_file(key, file_no, check, False))
    return out


def write_blocking(db: Rdict, batch: WriteBatch, path: str | None, blob: Blob,
                   dropped: list[str], sync: bool, dir_fd: int) -> None:
    """(on the tier's thread) The blob's file at ``path`` (complete, and fsynced with its
    directory entry when ``sync``), then the catalog ``batch``, then the ``dropped`` files
    it no longer names. ``path`` None: a value kept in the catalog (or a delete)."""
    if path is not None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:  # from here on the file is ours to remove if the put fails
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if sync:
                os.fsync(dir_fd)
            db.write(batch)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
    else:
        db.write(batch)
    for dropped_path in dropped:
        with contextlib.suppress(OSError):
            os.unlink(dropped_path)
