"""Start a real Overture cluster for integration tests: each service a process on free
loopback ports, readiness awaited, logs kept in files (shown in failure messages), and every
process stopped at the end, whatever happened."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.cli import free_port, service_command
from shared.proto import engine_pb2, engine_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"

# Fast failure detection keeps the fault tests short.
SCHEDULER_FLAGS = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.5,
    "no_node_wait_s": 1.0,
}
NODEMGR_FLAGS = {"heartbeat_interval_s": 0.2, "engine_status_timeout_s": 1.0}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


@dataclass
class Cluster:
    url: str
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    engine_addresses: dict[str, str] = field(default_factory=dict)

    def logs(self, lines: int = 40) -> str:
        """The end of every process's log, for assertion messages."""
        parts = []
        for p in self.procs.values():
            state = "running" if p.popen.poll() is None else f"exited {p.popen.returncode}"
            parts.append(f"----- {p.name} ({state}) -----\n{p.tail(lines)}")
        return "\n".join(parts)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def post(self, path: str, body: object, timeout: float = 60.0) -> tuple[int, dict]:
        """POST ``body`` (JSON, or raw bytes) and return the status and decoded JSON answer."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def text(self, path: str, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name].popen
        p.send_signal(sig)
        p.wait(timeout=10)

    def engine_status(self, node: str = "node0", timeout: float = 2.0) -> engine_pb2.EngineStatus:
        with grpc.insecure_channel(self.engine_addresses[node]) as ch:
            return engine_pb2_grpc.EngineStub(ch).Status(
                engine_pb2.EngineStatusRequest(), timeout=timeout
            )

    def wait_ready(self, nodes: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.name for p in self.procs.values() if p.popen.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up\n{self.logs()}")
            with contextlib.suppress(OSError, ValueError):
                status, body = self.get("/readyz", timeout=1.0)
                if status == 200 and len(body.get("healthy_nodes", [])) >= nodes:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready within {timeout:g}s\n{self.logs()}")

    def stop(self, grace_s: float = 10.0) -> None:
        for p in reversed(list(self.procs.values())):
            if p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()


def _spawn(cluster: Cluster, name: str, argv: list[str]) -> None:
    log = cluster.log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), OVERTURE_LOG_LEVEL="INFO")
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster.procs[name] = Proc(name, popen, log)


@contextlib.contextmanager
def start_cluster(
    work_dir: Path,
    model_path: Path,
    *,
    nodes: int = 1,
    dtype: str = "float32",
    scheduler_flags: dict[str, object] | None = None,
    engine_flags: dict[str, object] | None = None,
    ready_timeout: float = 180.0,
) -> Iterator[Cluster]:
    """Run scheduler + ``nodes`` × (kvstore, engine, nodemgr); stop them all on exit."""
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    cluster = Cluster(url=f"http://{HOST}:{http_port}", log_dir=log_dir)
    try:
        _spawn(
            cluster,
            "scheduler",
            service_command(
                "scheduler",
                {
                    "host": HOST,
                    "port": http_port,
                    "grpc_port": grpc_port,
                    **SCHEDULER_FLAGS,
                    **(scheduler_flags or {}),
                },
            ),
        )
        for i in range(nodes):
            node = f"node{i}"
            kv, eng, nm = free_port(), free_port(), free_port()
            cluster.engine_addresses[node] = f"{HOST}:{eng}"
            _spawn(
                cluster,
                f"{node}.kvstore",
                service_command("kvstore", {"host": HOST, "port": kv, "node_id": node}),
            )
            _spawn(
                cluster,
                f"{node}.engine",
                service_command(
                    "engine",
                    {
                        "host": HOST,
                        "port": eng,
                        "model_path": model_path,
                        "dtype": dtype,
                        **(engine_flags or {}),
                    },
                ),
            )
            _spawn(
                cluster,
                f"{node}.nodemgr",
                service_command(
                    "nodemgr",
                    {
                        "host": HOST,
                        "port": nm,
                        "node_id": node,
                        "scheduler_address": f"{HOST}:{grpc_port}",
                        "engine_address": f"{HOST}:{eng}",
                        "kvstore_address": f"{HOST}:{kv}",
                        **NODEMGR_FLAGS,
                    },
                ),
            )
        cluster.wait_ready(nodes, ready_timeout)
        yield cluster
    finally:
        cluster.stop()
