"""Run a cluster's processes as children of one supervisor (``overture up``).

Children start in order (one with a readiness check is waited for before the next: the
S3 server), their output is prefixed with their name and streamed, and the URL is
printed once the scheduler reports enough healthy nodes. One child's death does not take
the cluster down: it is logged (exit code or signal) and the child restarted after a
growing backoff (``RestartPolicy``). A child that keeps crashing is given up on: a node's
service takes its node's other services with it while the other nodes keep serving; the
scheduler or the S3 server (or the last node) stops the cluster with exit code 1.
Ctrl-C or SIGTERM stops them all: SIGTERM in reverse start order, SIGKILL after a grace
period, those marked ``stop_last`` (the S3 server) only once the rest are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

STOP_GRACE_S = 10.0
# Services exit with 2 on a start-up failure the operator must fix (shared/service_main):
# restarting cannot help, so such a child is given up on at once.
CANNOT_START = 2
CHILD_READY_S = 60.0  # a child with a readiness check (the S3 server) must pass it by then


@dataclass(frozen=True)
class ChildSpec:
    name: str  # log prefix, e.g. "node0.engine"; "nodeK.<service>" belongs to node K
    argv: list[str]
    ready: Callable[[], bool] | None = None  # the next children start once this is true
    stop_last: bool = False  # stopped after every other child (the S3 server)
    metrics: str = ""  # host:port of the child's Prometheus /metrics ("": none)


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is restarted, and when it is given up on."""

    first_backoff_s: float = 0.5  # wait before the first restart; doubled for each next one
    max_backoff_s: float = 10.0
    stable_s: float = 30.0  # a child that was up this long starts over at first_backoff_s
    crash_loop_exits: int = 5  # this many exits within crash_loop_window_s: give up on it
    crash_loop_window_s: float = 120.0


def readiness(url: str, timeout_s: float = 2.0) -> dict | None:
    """The scheduler's /readyz body when it answers (ready or not), else None."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        with contextlib.suppress(ValueError):
            return json.loads(e.read())
    except (OSError, ValueError):
        pass
    return None


async def supervise(
    specs: list[ChildSpec],
    url: str,
    nodes: int,
    ready_timeout_s: float,
    *,
    restart: RestartPolicy = RestartPolicy(),
    stop: asyncio.Event | None = None,
) -> int:
    """Run ``specs`` until Ctrl-C, SIGTERM or ``stop`` is set (exit code 0), or until the
    cluster cannot go on: not ready within ``ready_timeout_s``, the scheduler or the S3
    server crash-looping, every node given up on (1). Every child is gone on return."""
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = _Cluster(specs, restart)
    try:
        return await cluster.run(url, nodes, ready_timeout_s, stop)
    finally:
        await cluster.retire(cluster.children)
        await asyncio.gather(*cluster.pumps, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@dataclass(eq=False)
class _Child:
    spec: ChildSpec
    node: str | None  # "node0" for "node0.engine"; None for the scheduler and the S3 server
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task[None] | None = None  # streams proc's output
    keeper: asyncio.Task[None] | None = None  # restarts it (cancelled: no more restarts)
    started_at: float = 0.0
    backoff_s: float = 0.0
    restarts: int = 0
    exits: deque[float] = field(default_factory=deque)  # within the crash-loop window


class _Cluster:
    def __init__(self, specs: list[ChildSpec], policy: RestartPolicy) -> None:
        self.children = [_Child(s, _node_of(s.name)) for s in specs]
        self.policy = policy
        self.pumps: list[asyncio.Task[None]] = []
        self.nodes = {c.node for c in self.children if c.node is not None}
        self.given_up: set[str] = set()
        self.failed = asyncio.Event()  # the cluster cannot go on

    async def run(self, url: str, nodes: int, ready_timeout_s: float, stop: asyncio.Event
                  ) -> int:
        t0 = time.monotonic()
        for c in self.children:
            p = await self.spawn(c)
            c.keeper = asyncio.create_task(self.keep(c))
            if c.spec.ready is not None and not await _started(p, c.spec, CHILD_READY_S):
                return 1
        ready = asyncio.create_task(
            _until_ready(url, lambda: nodes - len(self.given_up), ready_timeout_s, t0))
        stopped = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(self.failed.wait())
        try:
            done, _ = await asyncio.wait({ready, stopped, failed},
                                         return_when=asyncio.FIRST_COMPLETED)
            if done == {ready} and ready.result():
                done, _ = await asyncio.wait({stopped, failed},
                                             return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                print("stopping Overture ...", flush=True)
                return 0
            return 1
        finally:
            for t in (ready, stopped, failed):
                t.cancel()
            await asyncio.gather(ready, stopped, failed, return_exceptions=True)

    async def spawn(self, c: _Child) -> asyncio.subprocess.Process:
        p = await asyncio.create_subprocess_exec(
            *c.spec.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            limit=1 << 24,  # long log lines (tracebacks of big tensors) must not stall us
        )
        assert p.stdout is not None  # (stdout=PIPE)
        c.proc, c.started_at = p, time.monotonic()
        c.pump = asyncio.create_task(_pump(c.spec.name, p.stdout))
        self.pumps = [t for t in self.pumps if not t.done()] + [c.pump]
        _log(f"started {c.spec.name} (pid {p.pid})")
        return p

    async def keep(self, c: _Child) -> None:
        """Restart ``c`` whenever it exits, until it keeps crashing (then give up on it)."""
        try:
            await self._restart_until_crash_loop(c)
        except Exception as e:  # a restart failed (no memory, no file descriptors...)
            _log(f"could not keep {c.spec.name} running ({e!r}); stopping the cluster")
            self.failed.set()
            return
        pol = self.policy
        why = (f"{c.spec.name} keeps crashing ({len(c.exits)} exits in "
               f"{pol.crash_loop_window_s:g} s)" if len(c.exits) >= pol.crash_loop_exits
               else f"{c.spec.name} cannot start (see its log above)")
        if c.node is None:
            _log(f"{why}; stopping the cluster, which cannot serve without it")
            self.failed.set()
            return
        self.given_up.add(c.node)
        if self.given_up >= self.nodes:
            _log(f"{why}; giving up on {c.node}, the last node left; stopping the cluster")
            self.failed.set()
            return
        _log(f"{why}; giving up on {c.node} — the other nodes keep serving")
        await self.retire([s for s in self.children if s.node == c.node])

    async def _restart_until_crash_loop(self, c: _Child) -> None:
        pol, name = self.policy, c.spec.name
        c.backoff_s = pol.first_backoff_s
        while True:
            assert c.proc is not None and c.pump is not None  # (spawned before keep)
            rc = await c.proc.wait()
            await asyncio.wait({c.pump}, timeout=1.0)  # its last words (a traceback) first
            now = time.monotonic()
            _log(f"{name} (pid {c.proc.pid}) {_how_it_ended(rc)} after "
                 f"{now - c.started_at:.1f} s up")
            if now - c.started_at >= pol.stable_s:
                c.backoff_s = pol.first_backoff_s
            c.exits.append(now)
            while c.exits[0] < now - pol.crash_loop_window_s:
                c.exits.popleft()
            if len(c.exits) >= pol.crash_loop_exits or rc == CANNOT_START:
                return
            c.restarts += 1
            _log(f"restarting {name} in {c.backoff_s:g} s (restart {c.restarts})")
            await asyncio.sleep(c.backoff_s)
            c.backoff_s = min(2 * c.backoff_s, pol.max_backoff_s)
            p = await self.spawn(c)
            if c.spec.ready is not None and not await _started(p, c.spec, CHILD_READY_S):
                with contextlib.suppress(ProcessLookupError):
                    p.kill()  # counts as one more exit

    async def retire(self, children: list[_Child]) -> None:
        """Stop ``children`` for good: no more restarts, then ``_stop_all``."""
        me = asyncio.current_task()
        keepers = [c.keeper for c in children if c.keeper is not None and c.keeper is not me]
        for k in keepers:
            k.cancel()  # (one spawning a child kills it: asyncio does on cancellation)
        await asyncio.gather(*keepers, return_exceptions=True)
        started = [(c.proc, c.spec) for c in children if c.proc is not None]
        await _stop_all([p for p, _ in started], [s for _, s in started], STOP_GRACE_S)


def _node_of(name: str) -> str | None:
    node, dot, _ = name.partition(".")
    return node if dot else None


def _how_it_ended(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _pump(name: str, stream: asyncio.StreamReader) -> None:
    prefix = f"[{name}] ".encode()
    while line := await stream.readline():
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


async def _stop_all(
    procs: list[asyncio.subprocess.Process], specs: list[ChildSpec], grace_s: float
) -> None:
    """Stop the children, those marked ``stop_last`` once the others are gone."""
    first = [p for p, s in zip(procs, specs, strict=True) if not s.stop_last]
    last = [p for p, s in zip(procs, specs, strict=True) if s.stop_last]
    await _stop(first, grace_s)
    await _stop(last, grace_s)


async def _started(p: asyncio.subprocess.Process, spec: ChildSpec, timeout_s: float) -> bool:
    """Wait until ``spec.ready()`` (False: the child exited or took too long)."""
    if spec.ready is None:
        return True
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(spec.ready):
        if p.returncode is not None or time.monotonic() > deadline:
            _log(f"{spec.name} did not start (exit code {p.returncode})")
            return False
        await asyncio.sleep(0.1)
    return True


async def _stop(procs: list[asyncio.subprocess.Process], grace_s: float) -> None:
    """SIGTERM in reverse start order, wait up to ``grace_s``, then SIGKILL what is left."""
    for p in reversed(procs):
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace_s)
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        await asyncio.gather(*(p.wait() for p in procs))


async def _until_ready(
    url: str, nodes: Callable[[], int], timeout_s: float, started: float
) -> bool:
    """Wait until the scheduler reports ``nodes()`` healthy nodes (those not given up on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        body = await asyncio.to_thread(readiness, url)
        if body and len(body.get("healthy_nodes", [])) >= nodes():
            models = ", ".join(body.get("models", []))
            print(
                f"\nOverture is ready at {url}  ({nodes()} node(s), model {models}; "
                f"started in {time.monotonic() - started:.1f}s; Ctrl-C stops it)\n",
                flush=True,
            )
            return True
        await asyncio.sleep(0.25)
    print(f"the cluster was not ready within {timeout_s:g}s", file=sys.stderr, flush=True)
    return False
