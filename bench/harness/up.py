"""A cluster as a user starts it: ``overture up`` (the random-weight demo model of a size,
fp32) as one process in a working directory, which keeps its state and demo model there.
Ready once it says so; stopped as Ctrl-C stops it (SIGINT; SIGKILL after 30 s, and any of
its children still alive then, by pid: they run in sessions of their own).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.harness.cluster import Cluster
from bench.harness.processes import Proc
from services.local_cluster import free_port

READY_LINE = re.compile(r"Overture is ready at (\S+)")
STOP_WAIT_S = 30.0

log = logging.getLogger(__name__)


@contextlib.contextmanager
def overture_up(work_dir: Path, *, nodes: int = 2, size: str = "small",
                cores: str = "divided", s3: bool = False, extra_args: Sequence[str] = (),
                ready_timeout: float = 600.0, label: str = "") -> Iterator[Cluster]:
    """``overture up --nodes N --size SIZE --cores CORES [--no-s3] EXTRA`` in ``work_dir``
    (its log there as ``up-<label or cores>.log``); stopped on exit."""
    work_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cluster = Cluster(url=f"http://127.0.0.1:{port}", log_dir=work_dir)
    argv = [sys.executable, "-m", "services.cli", "up", "--nodes", str(nodes), "--size", size,
            "--port", str(port), *([] if s3 else ["--no-s3"]), "--cores", cores, *extra_args]
    name = f"up-{label or cores}"
    log.info("starting %s (log %s) ...", shlex.join(argv[1:]), work_dir / f"{name}.log")
    t0 = time.monotonic()
    try:
        proc = cluster.spawn(name, argv, cwd=work_dir, stop_signal=signal.SIGINT,
                             reap_children=True)
        _wait_ready(proc, t0, ready_timeout)
        log.info("cluster (%s cores) ready at %s in %.0f s, model %s", cores, cluster.url,
                 time.monotonic() - t0, cluster.model)
        yield cluster
    finally:
        cluster.stop(STOP_WAIT_S)
        log.info("cluster (%s cores) stopped", cores)


def show_progress() -> None:
    """Print the harness's progress (a cluster starting, ready, stopped) on stderr with the
    time of day, as a bench's own progress lines: for a bench's ``main``."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")


def _wait_ready(proc: Proc, t0: float, timeout: float) -> None:
    while not READY_LINE.search(proc.log.read_text(errors="replace")):
        if proc.popen.poll() is not None:
            raise RuntimeError(f"overture up exited with {proc.popen.returncode}:\n"
                               + proc.tail(30))
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"overture up not ready in {timeout:g} s:\n" + proc.tail(30))
        time.sleep(0.25)
