"""A real S3 endpoint on its own: the SeaweedFS gateway ``overture up`` runs, as a child
process on free loopback ports, its data in a temporary folder.

    endpoint_url, stop = start_s3_server()
    ...
    stop()

``port`` fixes the S3 port: a test that starts with S3 down brings it up there later.
Callers make their own buckets (the S3 tier creates a missing one when it opens). A
cluster's S3 server is started with the cluster instead (``start_cluster(s3=True)``).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.harness.secret import cluster_s3_credentials
from services.s3_server import s3_server_spec, wait_ready


def start_s3_server(port: int = 0, timeout_s: float = 60.0) -> tuple[str, Callable[[], None]]:
    """Start ``weed mini`` on 127.0.0.1 as ``overture up`` does (it admits the pair of the
    harness's cluster secret only: ``s3_keys()``); return (endpoint_url, stop)."""
    data = Path(tempfile.mkdtemp(prefix="overture-s3-"))
    spec = s3_server_spec(data, cluster_s3_credentials(), s3_port=port)
    proc = subprocess.Popen(spec.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(spec, timeout_s, alive=lambda: proc.poll() is None)
    except Exception:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
        raise

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(data, ignore_errors=True)

    return spec.endpoint_url, stop
