"""The shared-memory file behind the KV pool and the Reuse Store's arena: sparse, pages
punched out in every mapping, and no file outliving a killed owner."""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

from shared.shm_file import CREATING_S, ShmFile, remove_stale_files


def test_stale_files_are_told_by_their_lock_not_their_pid(tmp_path: Path) -> None:
    """/dev/shm shared across containers: a pid in a file name may belong to another PID
    namespace. A file is live while its owner holds its lock, whatever the pid says."""

    def held(path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    # Another namespace's live engine: a pid that means nothing here, its lock held.
    foreign = tmp_path / "overture-kv-999999999-abc"
    foreign_fd = held(foreign)
    # A dead engine of this namespace whose pid a live process now has: no lock held.
    stale = tmp_path / f"overture-kv-{os.getpid()}-def"
    stale.write_bytes(b"x")
    # Being created right now (not yet renamed), and one a crash left half-made long ago.
    creating = tmp_path / ".overture-kv-creating-1-ghi"
    creating.write_bytes(b"x")
    old = tmp_path / ".overture-kv-creating-2-jkl"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 2 * CREATING_S,) * 2)
    other = tmp_path / "unrelated-1-x"
    other.write_bytes(b"x")
    try:
        assert sorted(remove_stale_files(tmp_path, "overture-kv")) == sorted([stale, old])
        assert foreign.exists() and creating.exists() and other.exists()
    finally:
        os.close(foreign_fd)
    assert remove_stale_files(tmp_path, "overture-kv") == [foreign]  # its owner is gone


def test_memory_is_committed_where_written_and_punched_out_everywhere(tmp_path: Path) -> None:
    page = mmap.PAGESIZE
    f = ShmFile(64 * page, "overture-test", tmp_path, label="node0")
    try:
        assert f.path.name.startswith("overture-test-node0-")
        assert f.resident_bytes() == 0  # sparse
        assert f.allocate(0, 4 * page)
        assert f.resident_bytes() == 4 * page
        # Another process's mapping sees the bytes, and loses them when they are punched.
        f.mm[page:page + 3] = b"abc"
        with open(f.path, "r+b") as other, mmap.mmap(other.fileno(), 64 * page) as seen:
            assert seen[page:page + 3] == b"abc"
            f.punch(page - 1, 2 * page + 2)  # the whole pages inside: [page, 3 page)
            assert seen[page:page + 3] == b"\0\0\0"
        assert f.resident_bytes() == 2 * page
    finally:
        f.close()
    assert not f.path.exists()
    f.close()  # (twice is harmless)


def test_a_file_whose_owner_was_killed_is_removed_by_the_next_owner(tmp_path: Path) -> None:
    # A process that creates a weights arena and is killed with SIGKILL cannot unlink it.
    code = ("import sys, time\n"
            "from shared.shm_file import ShmFile\n"
            f"f = ShmFile(1 << 20, 'overture-weights', {str(tmp_path)!r})\n"
            "f.allocate(0, 1 << 16)\n"
            "print(f.path, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[3])
    try:
        assert proc.stdout is not None
        left = Path(proc.stdout.readline().strip())
        assert left.exists()
        survivor = ShmFile(1 << 20, "overture-weights", tmp_path)  # owner alive: kept
        assert left.exists()
        survivor.close()
    finally:
        proc.kill()
        proc.wait()
    assert left.exists()
    successor = ShmFile(1 << 20, "overture-weights", tmp_path)
    try:
        assert not left.exists()
    finally:
        successor.close()
