"""A real S3 endpoint for tests: a moto server subprocess on a free loopback port.

    endpoint_url, stop = start_moto_server()
    ...
    stop()

Reusable by any test that needs S3 (the kvstore's tests, cluster tests).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto_server(timeout_s: float = 30.0, port: int = 0) -> tuple[str, Callable[[], None]]:
    """Start ``python -m moto.server`` on 127.0.0.1; return (endpoint_url, stop).

    ``port`` 0 picks a free one; a test restarts S3 on a known port to simulate recovery.
    """
    port = port or free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/moto-api/", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start in time") from None
            time.sleep(0.1)

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    return url, stop
