"""The processes of a harness cluster: each started in a session of its own with its
output in a log file (shown when something fails), and stopped by a signal, killed after
a grace period, whatever happened meanwhile.

A process that starts children of its own in sessions of their own (``overture up``) is
started with ``reap_children``: its descendants are noted before it is asked to stop, and
any of them still alive afterwards is killed by pid (with its start time, so that a pid
reused meanwhile is left alone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.local_cluster import service_command

REPO = Path(__file__).resolve().parents[2]

log = logging.getLogger(__name__)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    stop_signal: int = signal.SIGTERM
    reap_children: bool = False

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def state(self) -> str:
        return "running" if self.popen.poll() is None else f"exited {self.popen.returncode}"


def start_process(name: str, argv: Sequence[str], log_path: Path,
                  env_only: dict[str, str] | None = None, *, cwd: Path = REPO,
                  stop_signal: int = signal.SIGTERM, reap_children: bool = False) -> Proc:
    """Start ``argv`` as process ``name``, its output into ``log_path``. With ``env_only``
    its OVERTURE_* settings are those alone (none inherited from this process)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OVERTURE_LOG_LEVEL="INFO")
    if env_only is not None:
        env = {k: v for k, v in env.items()
               if not k.startswith("OVERTURE_") or k == "OVERTURE_LOG_LEVEL"}
        env.update(env_only)
    # A file, not a pipe: nothing stalls on a full pipe while the caller is busy, and the
    # log stays there to read when something goes wrong.
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    return Proc(name, popen, log_path, stop_signal, reap_children)


def start_service(name: str, flags: dict[str, object], log_path: Path) -> Proc:
    """``python -m services.<name> --flag value ...`` as process ``name`` (a service on its
    own, outside any cluster: a bench driving one kvstore, say)."""
    return start_process(name, service_command(name, flags), log_path)


def stop_processes(procs: Sequence[Proc], grace_s: float) -> None:
    """Signal ``procs`` in reverse order, wait up to ``grace_s`` for them all, kill what is
    left (and the children left behind by those with ``reap_children``)."""
    families = {p.name: _descendants(p.popen.pid) for p in procs
                if p.reap_children and p.popen.poll() is None}
    for p in reversed(procs):
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(p.stop_signal)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %g s; killing it", p.name, grace_s)
            p.popen.kill()
            p.popen.wait()
    for name, family in families.items():
        left = [pid for pid, start in family if _start_time(pid) == start]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left:
            log.warning("killed %d leftover process(es) of %s: %s", len(left), name, left)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time): a pid together with it names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[tuple[int, str]] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        start = _start_time(pid)
        if start is not None:
            out.append((pid, start))
        todo.extend(children.get(pid, []))
    return out
