"""The supervisor of ``overture up`` with real (tiny) child processes: a dead child is
restarted, a crash-looping node is given up while the others keep running, a
crash-looping scheduler or S3 server stops the cluster, and no child outlives it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable

import pytest

from services.supervisor import ChildSpec, RestartPolicy, supervise

FAST = RestartPolicy(
    first_backoff_s=0.05, max_backoff_s=0.2, stable_s=5.0, crash_loop_exits=3,
    crash_loop_window_s=30.0,
)
NEVER = 3600.0  # ready timeout: readiness never ends these runs


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEP = py("import time; time.sleep(60)")
GREET = py("import os, time; print('hello from', os.getpid(), flush=True); time.sleep(60)")
EXIT3 = py("import sys, time; time.sleep(0.05); sys.exit(3)")


def nothing_listening() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Run:
    """``supervise`` running as a task, with its output (stdout and stderr) collected."""

    def __init__(self, capsys: pytest.CaptureFixture[str], specs: list[ChildSpec],
                 policy: RestartPolicy = FAST, ready_timeout_s: float = NEVER) -> None:
        self.capsys, self.text = capsys, ""
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(supervise(
            specs, nothing_listening(), 1, ready_timeout_s, restart=policy, stop=self.stop))

    def output(self) -> str:
        out = self.capsys.readouterr()
        self.text += out.out + out.err
        return self.text

    def pids(self, name: str) -> list[int]:
        """Every pid ``name`` had, in start order (from the ``started`` lines)."""
        found = re.findall(rf"^started {re.escape(name)} \(pid (\d+)\)$", self.output(), re.M)
        return [int(pid) for pid in found]

    def all_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"^started \S+ \(pid (\d+)\)$", self.output(), re.M)]

    async def until(self, check: Callable[[], object], timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert not self.task.done(), f"supervise ended early:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out:\n{self.output()}"
            await asyncio.sleep(0.02)

    async def stopped(self) -> int:
        self.stop.set()
        return await self.ended()

    async def ended(self, timeout_s: float = 5.0) -> int:
        code = await asyncio.wait_for(self.task, timeout_s)
        left = [pid for pid in self.all_pids() if alive(pid)]
        assert not left, f"children outlived the supervisor: {left}\n{self.output()}"
        return code


async def test_a_killed_child_is_restarted_and_its_output_still_streamed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = Run(capsys, [ChildSpec("scheduler", SLEEP), ChildSpec("node0.engine", GREET)])
    await run.until(lambda: "[node0.engine] hello from" in run.output())
    [scheduler] = run.pids("scheduler")
    [first] = run.pids("node0.engine")
    os.kill(first, signal.SIGKILL)
    await run.until(lambda: len(run.pids("node0.engine")) == 2)
    second = run.pids("node0.engine")[1]
    assert second != first
    await run.until(lambda: f"[node0.engine] hello from {second}" in run.output())
    text = run.output()
    assert f"node0.engine (pid {first}) was killed by SIGKILL" in text
    assert "restarting node0.engine in 0.05 s (restart 1)" in text
    assert run.pids("scheduler") == [scheduler] and alive(scheduler)
    assert await run.stopped() == 0
    assert "stopping Overture" in run.output()


async def test_sigterm_stops_everything(capsys: pytest.CaptureFixture[str]) -> None:
    run = Run(capsys, [ChildSpec("scheduler", SLEEP), ChildSpec("node0.engine", SLEEP)])
    await run.until(lambda: len(run.all_pids()) == 2)
    os.kill(os.getpid(), signal.SIGTERM)  # as `kill <overture up>` does (Ctrl-C: SIGINT)
    assert await run.ended() == 0


async def test_a_crash_looping_node_is_given_up_while_the_others_keep_serving(
    capsys: pytest.CaptureFixture[str],
) -> None:
    specs = [
        ChildSpec("scheduler", SLEEP),
        ChildSpec("node0.kvstore", SLEEP),
        ChildSpec("node0.engine", EXIT3),
        ChildSpec("node0.nodemgr", SLEEP),
        ChildSpec("node1.kvstore", SLEEP),
        ChildSpec("node1.engine", SLEEP),
    ]
    run = Run(capsys, specs)
    await run.until(lambda: "giving up on node0" in run.output())
    text = run.output()
    assert "node0.engine keeps crashing (3 exits in 30 s)" in text
    assert "the other nodes keep serving" in text
    assert re.search(r"node0\.engine \(pid \d+\) exited with code 3", text)
    assert "restarting node0.engine in 0.05 s (restart 1)" in text
    assert "restarting node0.engine in 0.1 s (restart 2)" in text  # the backoff doubles
    assert len(run.pids("node0.engine")) == 3
    siblings = run.pids("node0.kvstore") + run.pids("node0.nodemgr")
    await run.until(lambda: not any(alive(pid) for pid in siblings))
    await asyncio.sleep(0.3)  # nothing of node0 comes back, the rest keeps running
    assert len(run.pids("node0.engine")) == 3 and len(siblings) == 2
    others = run.pids("scheduler") + run.pids("node1.kvstore") + run.pids("node1.engine")
    assert len(others) == 3 and all(alive(pid) for pid in others)
    assert not run.task.done()
    assert await run.stopped() == 0


@pytest.mark.parametrize("name", ["scheduler", "s3"])
async def test_a_crash_looping_scheduler_or_s3_server_stops_the_cluster(
    capsys: pytest.CaptureFixture[str], name: str,
) -> None:
    ready_checks: list[int] = []

    def ready() -> bool:
        ready_checks.append(1)
        return True

    crasher = (ChildSpec("s3", EXIT3, ready, stop_last=True) if name == "s3"
               else ChildSpec("scheduler", EXIT3))
    others = [ChildSpec("scheduler", SLEEP)] if name == "s3" else []
    run = Run(capsys, [crasher, *others, ChildSpec("node0.engine", SLEEP)])
    assert await run.ended() == 1
    assert f"{name} keeps crashing (3 exits in 30 s); stopping the cluster" in run.output()
    if name == "s3":
        assert len(ready_checks) == 3  # at start and after each restart


async def test_the_last_node_given_up_stops_the_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = Run(capsys, [ChildSpec("scheduler", SLEEP), ChildSpec("node0.engine", EXIT3)])
    assert await run.ended() == 1
    assert "giving up on node0, the last node left; stopping the cluster" in run.output()


async def test_a_child_waiting_for_its_restart_is_not_restarted_once_stopping(
    capsys: pytest.CaptureFixture[str],
) -> None:
    slow = RestartPolicy(first_backoff_s=30.0)
    run = Run(capsys, [ChildSpec("scheduler", SLEEP), ChildSpec("node0.engine", EXIT3)], slow)
    await run.until(lambda: "restarting node0.engine in 30 s (restart 1)" in run.output())
    t0 = time.monotonic()
    assert await run.stopped() == 0
    assert time.monotonic() - t0 < 2
    assert len(run.pids("node0.engine")) == 1


async def test_the_backoff_starts_over_after_a_stable_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy = RestartPolicy(first_backoff_s=0.05, stable_s=0.2, crash_loop_exits=100)
    lasting = py("import sys, time; time.sleep(0.25); sys.exit(1)")
    run = Run(capsys, [ChildSpec("node0.engine", lasting)], policy)
    await run.until(lambda: "(restart 3)" in run.output())
    assert re.findall(r"restarting node0\.engine in (\S+) s", run.output()) == ["0.05"] * 3
    assert await run.stopped() == 0


async def test_a_cluster_not_ready_in_time_stops(capsys: pytest.CaptureFixture[str]) -> None:
    run = Run(capsys, [ChildSpec("scheduler", SLEEP), ChildSpec("node0.engine", SLEEP)],
              ready_timeout_s=0.3)
    assert await run.ended() == 1
    assert "the cluster was not ready within 0.3s" in run.output()
    assert len(run.all_pids()) == 2


async def test_a_child_that_cannot_start_is_not_restarted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Exit status 2 is a service's "fix the configuration" exit: restarting cannot help.
    specs = [
        ChildSpec("scheduler", SLEEP),
        ChildSpec("node0.engine", py("import sys; sys.exit(2)")),
        ChildSpec("node0.nodemgr", SLEEP),
        ChildSpec("node1.engine", SLEEP),
    ]
    run = Run(capsys, specs)
    await run.until(lambda: "giving up on node0" in run.output())
    assert "node0.engine cannot start" in run.output()
    assert "restarting node0.engine" not in run.output()
    assert len(run.pids("node0.engine")) == 1
    assert await run.stopped() == 0
