"""The S3 server ``overture up`` starts is closed to outsiders (issue 43, finding 1).

Started here exactly as ``overture up`` does (``s3_server_spec(...).argv()``), with the
keys of the harness's cluster secret: a signed client works; anonymous list, get, put and
delete get 403 and change nothing; the filer's own HTTP port, which serves the same
objects, refuses requests without its JWT; the data folder is owner-only.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import cluster_s3_credentials
from services.s3_server import S3ServerSpec, s3_server_spec, wait_ready

KEY = "tenant-a/session-1@fp/chunk"


@pytest.fixture(scope="module")
def server() -> Iterator[S3ServerSpec]:
    data = Path(tempfile.mkdtemp(prefix="overture-s3-closed-")) / "s3"
    spec = s3_server_spec(data, cluster_s3_credentials())
    proc = subprocess.Popen(spec.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(spec, 90.0, alive=lambda: proc.poll() is None)
        spec.client().put_object(Bucket=spec.bucket, Key=KEY, Body=b"kv bytes" * 100)
        yield spec
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data.parent, ignore_errors=True)


def _anonymous(method: str, url: str, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _object(spec: S3ServerSpec, key: str = KEY) -> bytes:
    body: bytes = spec.client().get_object(Bucket=spec.bucket, Key=key)["Body"].read()
    return body


def test_anonymous_s3_requests_are_refused(server: S3ServerSpec) -> None:
    bucket = f"{server.endpoint_url}/{server.bucket}"
    assert _anonymous("GET", f"{bucket}/") == 403  # list: the keys name tenants, sessions
    assert _anonymous("GET", f"{bucket}/?list-type=2") == 403
    assert _anonymous("GET", f"{bucket}/{KEY}") == 403
    assert _anonymous("HEAD", f"{bucket}/{KEY}") == 403
    assert _anonymous("PUT", f"{bucket}/{KEY}", b"forged") == 403
    assert _anonymous("PUT", f"{bucket}/tenant-a/new", b"forged") == 403
    assert _anonymous("DELETE", f"{bucket}/{KEY}") == 403
    assert _object(server) == b"kv bytes" * 100  # untouched
    keys = [o["Key"] for o in server.client().list_objects_v2(Bucket=server.bucket)["Contents"]]
    assert keys == [KEY]


def test_the_filer_port_does_not_serve_the_objects(server: S3ServerSpec) -> None:
    filer = f"http://{server.host}:{server.ports['filer']}/buckets/{server.bucket}"
    for method, url, body in [("GET", f"{filer}/{KEY}", None), ("GET", f"{filer}/", None),
                              ("PUT", f"{filer}/tenant-a/x", b"forged"),
                              ("DELETE", f"{filer}/{KEY}", None)]:
        assert _anonymous(method, url, body) in (401, 403), (method, url)
    assert _object(server) == b"kv bytes" * 100


def test_keys_and_data_are_owner_only_and_off_the_command_line(server: S3ServerSpec) -> None:
    creds = server.credentials
    argv = " ".join(server.argv())
    assert creds.secret_access_key not in argv and creds.access_key_id not in argv
    assert creds.signing_key not in argv
    assert creds.secret_access_key not in str(server.kvstore_flags())
    assert f"-ip.bind={server.host}" in argv and server.host == "127.0.0.1"
    assert stat.S_IMODE(server.data_dir.stat().st_mode) == 0o700
    for f in (server.identities_path, server.data_dir / "security.toml"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    data_files = [p for p in server.data_dir.rglob("*") if p.suffix in (".dat", ".idx")]
    assert data_files
    for p in data_files:  # (weed creates them under the umask it is run with)
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
