"""A cluster started service by service: each service a process of this harness on free
loopback ports (a scheduler, then per node a kvstore, an engine per model and a node
manager; optionally one SeaweedFS S3 server for every kvstore), readiness awaited, logs
kept in files, every process stopped at the end whatever happened. Flags reach each
service directly, so a test or a bench can shape one service without a config file.
Fast failure detection (heartbeats every 0.2 s) keeps the fault tests short.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.harness.cluster import Cluster
from bench.harness.secret import cluster_s3_credentials, use_cluster_secret
from services.local_cluster import free_port, service_command
from services.s3_server import S3ServerError, s3_server_spec, wait_ready
from shared import internal_auth
from shared.device_ledger import create_ledger

HOST = "127.0.0.1"

SCHEDULER_FLAGS = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.5,
    "no_node_wait_s": 1.0,
    "anonymous": True,
}
NODEMGR_FLAGS = {"heartbeat_interval_s": 0.2, "engine_status_timeout_s": 1.0}


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
    cluster = _new_cluster(work_dir)
    try:
        s3_flags = _start_s3(cluster, work_dir / "s3") if s3 else {}
        _start_scheduler(cluster, {
            **({"models_config": models_config} if models_config else {}),
            **(scheduler_flags or {}),
        })
        for i in range(nodes):
            node = f"node{i}"
            kv, eng, nm = free_port(), free_port(), free_port()
            cluster.engine_addresses[node] = f"{HOST}:{eng}"
            cluster.kvstore_addresses[node] = f"{HOST}:{kv}"
            cluster.nodemgr_addresses[node] = f"{HOST}:{nm}"
            cluster.spawn(f"{node}.kvstore", service_command("kvstore", {
                "host": HOST, "port": kv, "node_id": node, **s3_flags,
                **({"ssd_path": work_dir / node / "ssd"} if ssd else {}),
                **(kvstore_flags or {}),
            }))
            ledger = ({"device_ledger": create_ledger(work_dir / f"{node}.ledger", node_memory)}
                      if node_memory else {})
            engines = [f"{HOST}:{eng}"]
            for j, path in enumerate((model_path, *more_models, *([None] * pool_engines))):
                port = eng if j == 0 else free_port()
                if j:
                    engines.append(f"{HOST}:{port}")
                cluster.spawn(f"{node}.engine" + (str(j) if j else ""), service_command(
                    "engine", {
                        "host": HOST,
                        "port": port,
                        **({"model_path": path} if path else {"standby": "true"}),
                        "dtype": dtype,
                        "offload.kvstore_address": f"{HOST}:{kv}",
                        **ledger,
                        **(engine_flags or {}),
                    }))
            cluster.spawn(f"{node}.nodemgr", service_command("nodemgr", {
                "host": HOST,
                "port": nm,
                "node_id": node,
                "scheduler_address": cluster.scheduler_grpc,
                "engine_addresses": ",".join(engines),
                "kvstore_address": f"{HOST}:{kv}",
                **ledger,
                **({"models_config": models_config} if models_config else {}),
                **NODEMGR_FLAGS,
                **(nodemgr_flags or {}),
            }))
        cluster.wait_ready(nodes, ready_timeout)
        cluster.wait_attached(ready_timeout)
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def start_scheduler(work_dir: Path, flags: dict[str, object] | None = None,
                    ready_timeout: float = 60.0) -> Iterator[Cluster]:
    """A scheduler alone (no node): what its public HTTP server does by itself."""
    cluster = _new_cluster(work_dir)
    try:
        _start_scheduler(cluster, flags or {})
        deadline = time.monotonic() + ready_timeout
        while not _healthy(cluster):
            cluster.check_alive("during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler not up within {ready_timeout:g}s\n"
                                   f"{cluster.logs()}")
            time.sleep(0.1)
        yield cluster
    finally:
        cluster.stop()


def _new_cluster(work_dir: Path) -> Cluster:
    if internal_auth.current() is None:  # (a benchmark, outside the test suite)
        use_cluster_secret()
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return Cluster(url=f"http://{HOST}:{free_port()}", log_dir=log_dir,
                   scheduler_grpc=f"{HOST}:{free_port()}")


def _start_s3(cluster: Cluster, data_dir: Path) -> dict[str, object]:
    """The cluster's S3 server, ready; the kvstore flags that point at it.

    Its five ports (and their gRPC siblings) are free when picked but another process on
    the machine may take one before ``weed`` binds it: a server that exits during
    start-up is started again on fresh ports, twice at most."""
    for attempt in range(3):
        spec = s3_server_spec(data_dir, cluster_s3_credentials())
        proc = cluster.spawn("s3", spec.argv()).popen
        try:
            wait_ready(spec, 60.0, alive=_running(proc))
        except S3ServerError:
            if proc.poll() is None or attempt == 2:
                raise S3ServerError(f"the S3 server did not start\n{cluster.logs()}") from None
            continue
        cluster.s3_endpoint = spec.endpoint_url
        return spec.kvstore_flags()
    raise AssertionError("unreachable")


def _running(proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: proc.poll() is None


def _start_scheduler(cluster: Cluster, flags: dict[str, object]) -> None:
    http_port = int(cluster.url.rsplit(":", 1)[1])
    grpc_port = int(cluster.scheduler_grpc.rsplit(":", 1)[1])
    cluster.spawn("scheduler", service_command("scheduler", {
        "host": HOST, "port": http_port, "grpc_port": grpc_port, **SCHEDULER_FLAGS, **flags,
    }))


def restart_scheduler(cluster: Cluster, flags: dict[str, object] | None = None) -> None:
    """Start the cluster's scheduler again on its ports (after ``cluster.kill("scheduler")``)
    with ``flags`` (those it started with, for the same state); the nodes register again
    by themselves."""
    _start_scheduler(cluster, flags or {})


def _healthy(cluster: Cluster) -> bool:
    try:
        with urllib.request.urlopen(cluster.url + "/healthz", timeout=1.0) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False
