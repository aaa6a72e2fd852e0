"""A running cluster as the benches and tests see it: its public URL with small HTTP
helpers, its processes and their logs, the addresses of each node's services, and the
waits and stops around them. Both ways of starting one (``by_service.start_cluster``:
every service a process of this harness; ``up.overture_up``: ``overture up`` as a user
runs it) hand back this; so does ``Cluster(url=...)`` around a cluster started otherwise.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from bench.harness.processes import REPO, Proc, start_process, stop_processes
from bench.harness.secret import sync_channel
from shared.proto import engine_pb2, engine_pb2_grpc


@dataclass
class Cluster:
    url: str
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    engine_addresses: dict[str, str] = field(default_factory=dict)
    kvstore_addresses: dict[str, str] = field(default_factory=dict)
    nodemgr_addresses: dict[str, str] = field(default_factory=dict)
    scheduler_grpc: str = ""
    s3_endpoint: str = ""

    # ---- processes

    def spawn(self, name: str, argv: Sequence[str], env_only: dict[str, str] | None = None,
              *, cwd: Path = REPO, stop_signal: int = signal.SIGTERM,
              reap_children: bool = False) -> Proc:
        """Start ``argv`` as this cluster's process ``name``, logging to ``log_dir``
        (``env_only``: its only OVERTURE_* settings; see ``processes.start_process``)."""
        proc = start_process(name, argv, self.log_dir / f"{name}.log", env_only, cwd=cwd,
                             stop_signal=stop_signal, reap_children=reap_children)
        self.procs[name] = proc
        return proc

    def logs(self, lines: int = 40) -> str:
        """The end of every process's log, for assertion messages."""
        return "\n".join(f"----- {p.name} ({p.state()}) -----\n{p.tail(lines)}"
                         for p in self.procs.values())

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name].popen
        p.send_signal(sig)
        p.wait(timeout=10)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process, the S3 server last."""
        stop_processes([p for p in self.procs.values() if p.name != "s3"], grace_s)
        stop_processes([p for p in self.procs.values() if p.name == "s3"], grace_s)

    # ---- readiness

    def wait_ready(self, nodes: int, timeout: float) -> None:
        """Until ``/readyz`` counts ``nodes`` healthy nodes (a process exiting meanwhile
        fails at once, with the logs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive("during start-up")
            with contextlib.suppress(OSError, ValueError):
                status, body = self.get("/readyz", timeout=1.0)
                if status == 200 and len(body.get("healthy_nodes", [])) >= nodes:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready within {timeout:g}s\n{self.logs()}")

    def wait_idle(self, nodes: int, timeout: float = 30.0) -> None:
        """Until ``nodes`` nodes are healthy and report nothing running, queued or routed
        (a test's next turn then goes by locality, not by load)."""
        deadline = time.monotonic() + timeout
        while True:
            status, ready = self.get("/readyz")
            reports = ready.get("nodes", {}).values()
            if status == 200 and len(ready.get("healthy_nodes", [])) == nodes == len(
                    reports) and all(n["running"] == n["waiting"] == n["routed"] == 0
                                     for n in reports):
                return
            assert time.monotonic() < deadline, (ready, self.logs())
            time.sleep(0.1)

    def wait_attached(self, timeout: float) -> None:
        """Wait until every engine has attached its KV pool to its node's kvstore (an
        engine serves before that, without KV reuse)."""
        deadline = time.monotonic() + timeout
        engines = [p for p in self.procs.values() if ".engine" in p.name]
        while not all("KV pool attached" in p.tail(400) or "without a model" in p.tail(400)
                      for p in engines):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines not attached within {timeout:g}s\n{self.logs()}")
            time.sleep(0.1)

    def check_alive(self, when: str) -> None:
        dead = [p.name for p in self.procs.values() if p.popen.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited {when}\n{self.logs()}")

    @cached_property
    def model(self) -> str:
        """The id of the first model the cluster serves."""
        return str(self.get("/v1/models", timeout=30.0)[1]["data"][0]["id"])

    # ---- HTTP

    def get(self, path: str, timeout: float = 5.0, headers: dict[str, str] | None = None
            ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def post(self, path: str, body: object, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
        """POST ``body`` (JSON, or raw bytes) and return the status and decoded JSON answer."""
        status, answer, _ = self.post_with_headers(path, body, timeout)
        return status, answer

    def post_with_headers(
        self, path: str, body: object, timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """``post``, with the response's headers too (and extra request ``headers``)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}"), dict(e.headers)

    def post_as(self, headers: dict[str, str], path: str, body: object = None
                ) -> tuple[int, dict[str, Any]]:
        """POST with ``headers`` (an API key, say): the status and decoded JSON answer."""
        status, answer, _ = self.post_with_headers(path, {} if body is None else body,
                                                   headers=headers)
        return status, answer

    def delete(self, path: str, timeout: float = 10.0, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, method="DELETE", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def text(self, path: str, timeout: float = 10.0, headers: dict[str, str] | None = None
             ) -> str:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return str(r.read().decode())

    # ---- gRPC

    def engine_status(self, node: str = "node0", timeout: float = 2.0) -> engine_pb2.EngineStatus:
        with sync_channel(self.engine_addresses[node]) as ch:
            status: engine_pb2.EngineStatus = engine_pb2_grpc.EngineStub(ch).Status(
                engine_pb2.EngineStatusRequest(), timeout=timeout)
        return status
