"""Where stored responses outlive the scheduler process: an archive of one small JSON
record per response, keyed by tenant and response id.

``ResponseStore`` keeps recent responses in memory and writes each one through to an
archive before its client sees it, so a ``previous_response_id`` still resolves after a
scheduler restart (or on the standby that takes over in Kubernetes). Three kinds:

    NullArchive   nothing persists (no state_dir, no S3): the old in-memory behaviour
    DiskArchive   <state_dir>/responses/<tenant>/<id>.json, owner-only, atomic replace
    S3Archive     s3://<bucket>/<prefix><tenant>/responses/<id>.json (``s3_archive.py``),
                  shared by every scheduler replica

A record carries its own expiry (wall-clock seconds): a reader drops an expired one. The
archive does no I/O on the event loop's behalf: callers reach it through
``asyncio.to_thread`` (``store.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

# The ids this scheduler makes (``items.new_item_id("resp")``); anything else is unknown
# and never becomes a file name or an object key.
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")


class ArchiveUnavailable(Exception):
    """The archive could not be read or written (S3 down, disk full)."""


class ResponseArchive(Protocol):
    """Blocking calls; safe from several threads at once."""

    def save(self, tenant: str, response_id: str, record: bytes) -> None:
        """Keep ``record`` (replacing any). Raises ArchiveUnavailable."""
        ...

    def load(self, tenant: str, response_id: str) -> bytes | None:
        """The record, or None when there is none. Raises ArchiveUnavailable."""
        ...

    def delete(self, tenant: str, response_id: str) -> None:
        """Forget the record (none: nothing happens). Raises ArchiveUnavailable."""
        ...

    def sweep(self, expired: ExpiredCheck) -> int:
        """Delete the records ``expired`` says are past their time; how many."""
        ...


class ExpiredCheck(Protocol):
    def __call__(self, record: bytes) -> bool: ...


class NullArchive:
    def save(self, tenant: str, response_id: str, record: bytes) -> None:
        pass

    def load(self, tenant: str, response_id: str) -> bytes | None:
        return None

    def delete(self, tenant: str, response_id: str) -> None:
        pass

    def sweep(self, expired: ExpiredCheck) -> int:
        return 0


def tenant_part(tenant: str) -> str:
    """A tenant's name as one path segment ('/' and '..' cannot climb out)."""
    return "t_" + quote(tenant, safe="")


class DiskArchive:
    """Files under ``root``, owner-only (0700 folders, 0600 files); a record is written
    to a temporary file and renamed into place, so a killed scheduler leaves either the
    old record or the new one, never half of one."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, tenant: str, response_id: str) -> Path:
        return self.root / tenant_part(tenant) / f"{response_id}.json"

    def save(self, tenant: str, response_id: str, record: bytes) -> None:
        path = self._path(tenant, response_id)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            os.replace(tmp, path)
        except OSError as e:
            raise ArchiveUnavailable(f"cannot write {path}: {e.strerror}") from None

    def load(self, tenant: str, response_id: str) -> bytes | None:
        try:
            return self._path(tenant, response_id).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ArchiveUnavailable(f"cannot read a stored response: {e.strerror}") from None

    def delete(self, tenant: str, response_id: str) -> None:
        try:
            self._path(tenant, response_id).unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            raise ArchiveUnavailable(f"cannot delete a stored response: {e.strerror}"
                                     ) from None

    def sweep(self, expired: ExpiredCheck) -> int:
        gone = 0
        for path in self.root.glob("t_*/resp_*.json"):
            with contextlib.suppress(OSError):
                if expired(path.read_bytes()):
                    path.unlink()
                    gone += 1
        return gone
