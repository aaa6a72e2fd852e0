"""The harness stops what it started, whatever the process does: a process that ignores
its stop signal is killed after the grace period, and one started with ``reap_children``
leaves no child behind (``overture up``'s children run in sessions of their own)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from bench.harness.cluster import Cluster
from bench.harness.processes import Proc, start_process, stop_processes

IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(60)")
LEAVES_A_CHILD = ("import subprocess, time; p = subprocess.Popen(['sleep', '60'], "
                  "start_new_session=True); print(p.pid, flush=True); time.sleep(60)")


def _first_line(proc: Proc, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not proc.log.read_text().strip():
        assert proc.popen.poll() is None and time.monotonic() < deadline, proc.tail()
        time.sleep(0.02)
    return proc.log.read_text().splitlines()[0]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (reparented to a pid 1 that does not reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def test_a_process_ignoring_its_signal_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = start_process("stubborn", [sys.executable, "-c", IGNORES_SIGTERM],
                         tmp_path / "stubborn.log")
    assert _first_line(proc) == "up"
    t0 = time.monotonic()
    stop_processes([proc], grace_s=0.5)
    assert proc.popen.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


def test_children_in_sessions_of_their_own_are_reaped(tmp_path: Path) -> None:
    proc = start_process("parent", [sys.executable, "-c", LEAVES_A_CHILD],
                         tmp_path / "parent.log", stop_signal=signal.SIGINT, reap_children=True)
    child = int(_first_line(proc))
    # (Under a runner started in the background SIGINT is ignored and the parent waits
    # for its kill: the grace is kept short, the children are what this checks.)
    stop_processes([proc], grace_s=0.5)
    assert proc.popen.returncode is not None
    deadline = time.monotonic() + 5
    while not _gone(child):
        assert time.monotonic() < deadline, f"child {child} outlived its parent's stop"
        time.sleep(0.02)


def test_a_cluster_s_logs_name_each_process_and_its_state(tmp_path: Path) -> None:
    cluster = Cluster(url="http://127.0.0.1:1", log_dir=tmp_path)
    cluster.spawn("quick", [sys.executable, "-c", "print('hello from quick')"]).popen.wait()
    cluster.spawn("stubborn", [sys.executable, "-c", IGNORES_SIGTERM])
    try:
        assert _first_line(cluster.procs["stubborn"]) == "up"
        logs = cluster.logs()
        assert "----- quick (exited 0) -----\nhello from quick" in logs
        assert "----- stubborn (running) -----\nup" in logs
    finally:
        cluster.stop(grace_s=0.5)
    assert all(p.popen.returncode is not None for p in cluster.procs.values())
