"""Run a cluster's processes as children of one supervisor (``overture up``).

Children start in order (one with a readiness check is waited for before the next: the
S3 server), their output is prefixed with their name and streamed, and the URL is
printed once the scheduler reports enough healthy nodes. Ctrl-C, SIGTERM or any child's
exit stops them all: SIGTERM in reverse start order, SIGKILL after a grace period, those
marked ``stop_last`` (the S3 server) only once the rest are gone.
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
from collections.abc import Callable
from dataclasses import dataclass

STOP_GRACE_S = 10.0
CHILD_READY_S = 60.0  # a child with a readiness check (the S3 server) must pass it by then


@dataclass(frozen=True)
class ChildSpec:
    name: str  # log prefix, e.g. "node0.engine"
    argv: list[str]
    ready: Callable[[], bool] | None = None  # the next children start once this is true
    stop_last: bool = False  # stopped after every other child (the S3 server)



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


async def _pump(name: str, stream: asyncio.StreamReader) -> None:
    prefix = f"[{name}] ".encode()
    while line := await stream.readline():
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


async def _stop_all(
    procs: list[asyncio.subprocess.Process], specs: list[ChildSpec], grace_s: float
) -> None:
    """Stop the children, those marked ``stop_last`` once the others are gone."""
    first = [p for p, s in zip(procs, specs, strict=False) if not s.stop_last]
    last = [p for p, s in zip(procs, specs, strict=False) if s.stop_last]
    await _stop(first, grace_s)
    await _stop(last, grace_s)


async def _started(p: asyncio.subprocess.Process, spec: ChildSpec, timeout_s: float) -> bool:
    """Wait until ``spec.ready()`` (False: the child exited or took too long)."""
    if spec.ready is None:
        return True
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(spec.ready):
        if p.returncode is not None or time.monotonic() > deadline:
            print(f"{spec.name} did not start (exit code {p.returncode})", file=sys.stderr,
                  flush=True)
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


async def supervise(specs: list[ChildSpec], url: str, nodes: int, ready_timeout_s: float) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task] = []
    started = time.monotonic()
    try:
        for spec in specs:
            p = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
                limit=1 << 24,  # long log lines (tracebacks of big tensors) must not stall us
            )
            procs.append(p)
            assert p.stdout is not None  # (stdout=PIPE)
            pumps.append(asyncio.create_task(_pump(spec.name, p.stdout)))
            if not await _started(p, spec, CHILD_READY_S):
                return 1
        waits = {
            asyncio.create_task(p.wait()): spec.name for p, spec in zip(procs, specs, strict=True)
        }
        stop_task = asyncio.create_task(stop.wait())
        ready_task = asyncio.create_task(_until_ready(url, nodes, ready_timeout_s, started))
        pending = set(waits) | {stop_task, ready_task}
        code = 0
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if stop_task in done:
                print("stopping Overture ...", flush=True)
                break
            if ready_task in done and not ready_task.result():
                code = 1
                break
            exited = [waits[t] for t in done if t in waits]
            if exited:
                print(f"{exited[0]} exited; stopping the cluster", file=sys.stderr, flush=True)
                code = 1
                break
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return code
    finally:
        await _stop_all(procs, specs, STOP_GRACE_S)
        await asyncio.gather(*pumps, return_exceptions=True)


async def _until_ready(url: str, nodes: int, timeout_s: float, started: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        body = await asyncio.to_thread(readiness, url)
        if body and len(body.get("healthy_nodes", [])) >= nodes:
            models = ", ".join(body.get("models", []))
            print(
                f"\nOverture is ready at {url}  ({nodes} node(s), model {models}; "
                f"started in {time.monotonic() - started:.1f}s; Ctrl-C stops it)\n",
                flush=True,
            )
            return True
        await asyncio.sleep(0.25)
    print(f"the cluster was not ready within {timeout_s:g}s", file=sys.stderr, flush=True)
    return False
