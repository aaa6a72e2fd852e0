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

from services.local_cluster import free_port, service_command
from services.s3_server import s3_server_spec, wait_ready
from shared import internal_auth
from shared.device_ledger import create_ledger
from shared.proto import engine_pb2, engine_pb2_grpc
from tests.internal import sync_channel, use_test_secret

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"

# Fast failure detection keeps the fault tests short.
SCHEDULER_FLAGS = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.5,
    "no_node_wait_s": 1.0,
    "anonymous": True,
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
    kvstore_addresses: dict[str, str] = field(default_factory=dict)
    nodemgr_addresses: dict[str, str] = field(default_factory=dict)
    scheduler_grpc: str = ""
    s3_endpoint: str = ""

    def logs(self, lines: int = 40) -> str:
        """The end of every process's log, for assertion messages."""
        parts = []
        for p in self.procs.values():
            state = "running" if p.popen.poll() is None else f"exited {p.popen.returncode}"
            parts.append(f"----- {p.name} ({state}) -----\n{p.tail(lines)}")
        return "\n".join(parts)

    def get(self, path: str, timeout: float = 5.0, headers: dict | None = None
            ) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def post(self, path: str, body: object, timeout: float = 60.0) -> tuple[int, dict]:
        """POST ``body`` (JSON, or raw bytes) and return the status and decoded JSON answer."""
        status, answer, _ = self.post_with_headers(path, body, timeout)
        return status, answer

    def post_with_headers(
        self, path: str, body: object, timeout: float = 60.0, headers: dict | None = None
    ) -> tuple[int, dict, dict[str, str]]:
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

    def post_as(self, headers: dict, path: str, body: object = None) -> tuple[int, dict]:
        """POST with ``headers`` (an API key, say): the status and decoded JSON answer."""
        status, answer, _ = self.post_with_headers(path, {} if body is None else body,
                                                   headers=headers)
        return status, answer

    def delete(self, path: str, timeout: float = 10.0, headers: dict | None = None
               ) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, method="DELETE", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def text(self, path: str, timeout: float = 10.0, headers: dict | None = None) -> str:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name].popen
        p.send_signal(sig)
        p.wait(timeout=10)

    def engine_status(self, node: str = "node0", timeout: float = 2.0) -> engine_pb2.EngineStatus:
        with sync_channel(self.engine_addresses[node]) as ch:
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

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process, the S3 server last."""
        services = [p for p in self.procs.values() if p.name != "s3"]
        self._stop(services, grace_s)
        self._stop([p for p in self.procs.values() if p.name == "s3"], grace_s)

    @staticmethod
    def _stop(procs: list[Proc], grace_s: float) -> None:
        for p in reversed(procs):
            if p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()


def _spawn(cluster: Cluster, name: str, argv: list[str],
           env_only: dict[str, str] | None = None) -> None:
    """Start ``argv`` as process ``name``; with ``env_only`` its OVERTURE_* settings are
    those alone (none inherited from this process)."""
    log = cluster.log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), OVERTURE_LOG_LEVEL="INFO")
    if env_only is not None:
        env = {k: v for k, v in env.items()
               if not k.startswith("OVERTURE_") or k == "OVERTURE_LOG_LEVEL"}
        env.update(env_only)
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
    kvstore_flags: dict[str, object] | None = None,
    nodemgr_flags: dict[str, object] | None = None,
    s3: bool = False,
    ssd: bool = False,
    ready_timeout: float = 180.0,
    more_models: tuple[Path, ...] = (),
    node_memory: int = 0,
    pool_engines: int = 0,
    models_config: Path | None = None,
) -> Iterator[Cluster]:
    """Run scheduler + ``nodes`` × (kvstore, engine, nodemgr); stop them all on exit.
    With ``ssd`` each kvstore has an SSD tier under ``work_dir``. With ``s3`` a SeaweedFS
    server (as ``overture up`` runs it) is every kvstore's S3 tier;
    it is started first and stopped last. ``more_models``: every node also runs an engine
    for each, its engines sharing ``node_memory`` bytes through a device ledger; plus
    ``pool_engines`` empty ones that ``models_config``'s catalogue models activate into."""
    if internal_auth.current() is None:  # (a benchmark, outside the test suite)
        use_test_secret()
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    cluster = Cluster(url=f"http://{HOST}:{http_port}", log_dir=log_dir,
                      scheduler_grpc=f"{HOST}:{grpc_port}")
    s3_flags: dict[str, object] = {}
    try:
        if s3:
            spec = s3_server_spec(work_dir / "s3")
            _spawn(cluster, "s3", spec.argv())
            s3_proc = cluster.procs["s3"].popen
            wait_ready(spec, 60.0, alive=lambda: s3_proc.poll() is None)
            s3_flags = spec.kvstore_flags()
            cluster.s3_endpoint = spec.endpoint_url
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
                    **({"models_config": models_config} if models_config else {}),
                    **(scheduler_flags or {}),
                },
            ),
        )
        for i in range(nodes):
            node = f"node{i}"
            kv, eng, nm = free_port(), free_port(), free_port()
            cluster.engine_addresses[node] = f"{HOST}:{eng}"
            cluster.kvstore_addresses[node] = f"{HOST}:{kv}"
            cluster.nodemgr_addresses[node] = f"{HOST}:{nm}"
            _spawn(
                cluster,
                f"{node}.kvstore",
                service_command("kvstore", {
                    "host": HOST, "port": kv, "node_id": node, **s3_flags,
                    **({"ssd_path": work_dir / node / "ssd"} if ssd else {}),
                    **(kvstore_flags or {}),
                }),
            )
            ledger = ({"device_ledger": create_ledger(work_dir / f"{node}.ledger", node_memory)}
                      if node_memory else {})
            engines = [f"{HOST}:{eng}"]
            for j, path in enumerate((model_path, *more_models, *([None] * pool_engines))):
                port = eng if j == 0 else free_port()
                if j:
                    engines.append(f"{HOST}:{port}")
                _spawn(
                    cluster,
                    f"{node}.engine" + (str(j) if j else ""),
                    service_command(
                        "engine",
                        {
                            "host": HOST,
                            "port": port,
                            **({"model_path": path} if path else {"standby": "true"}),
                            "dtype": dtype,
                            "offload.kvstore_address": f"{HOST}:{kv}",
                            **ledger,
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
                        "engine_addresses": ",".join(engines),
                        "kvstore_address": f"{HOST}:{kv}",
                        **ledger,
                        **({"models_config": models_config} if models_config else {}),
                        **NODEMGR_FLAGS,
                        **(nodemgr_flags or {}),
                    },
                ),
            )
        cluster.wait_ready(nodes, ready_timeout)
        cluster.wait_attached(ready_timeout)
        yield cluster
    finally:
        cluster.stop()
