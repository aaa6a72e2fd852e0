"""compose.yaml run without Docker: the same commands with the same environment, as
local processes on loopback. Every compose service name becomes 127.0.0.1 with a port of
its own, every named volume a folder; the init job writes the model and the cluster
secret, the S3 server is the compose one (``overture s3-server``). Then a two-turn chat
with an advisory: the second turn is served by the other node, with its KV reused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.local_cluster import free_port
from services.s3_server import S3ServerSpec, bucket_ready
from shared.internal_auth import InternalAuth
from shared.s3_credentials import derive_s3_credentials
from tests.cluster import REPO, Cluster
from tests.deploy_files import compose, environment, overture_services

KEY = {"Authorization": "Bearer sk-overture-local"}  # compose's default keys
ADMIN = {"Authorization": "Bearer sk-overture-admin"}
_PORT_VARS = re.compile(r"__(PORT|GRPC_PORT|METRICS_PORT|PEER_DATA_PORT)$")


class LocalCompose:
    """compose.yaml's Overture services, rewritten for loopback."""

    def __init__(self, doc: dict[str, Any], root: Path) -> None:
        self.services = overture_services(doc)
        self.names = sorted(self.services, key=len, reverse=True)  # (node1-engine first)
        self.ports: dict[tuple[str, str], int] = {}
        for name, svc in self.services.items():
            own = [v for k, v in environment(svc).items() if _PORT_VARS.search(k)]
            if "--s3-port" in svc["command"]:
                own.append(svc["command"][svc["command"].index("--s3-port") + 1])
            for port in own:
                self.ports[(name, port)] = free_port()
        self.volumes = {v: root / "volumes" / v for v in doc["volumes"]}
        for path in self.volumes.values():
            path.mkdir(parents=True, exist_ok=True)

    def port(self, service: str, port: int | str) -> int:
        return self.ports[(service, str(port))]

    def _rewrite(self, service: str, value: str, mounts: dict[str, Path]) -> str:
        for name in self.names:  # another service's address: its loopback port
            value = re.sub(rf"\b{re.escape(name)}:(\d+)",
                           lambda m, n=name: f"127.0.0.1:{self.port(n, m.group(1))}", value)
        for target, folder in mounts.items():
            if value == target or value.startswith(target + "/"):
                value = str(folder) + value[len(target):]
        return "127.0.0.1" if value == "0.0.0.0" else value

    def command(self, name: str) -> tuple[list[str], dict[str, str]]:
        svc = self.services[name]
        mounts = {m.split(":")[1]: self.volumes[m.split(":")[0]]
                  for m in svc.get("volumes") or [] if m.split(":")[0] in self.volumes}
        env = {}
        for key, value in environment(svc).items():
            if _PORT_VARS.search(key):
                env[key] = str(self.port(name, value))
            else:
                env[key] = self._rewrite(name, value, mounts)
        args = [self._rewrite(name, a, mounts) for a in svc["command"]]
        if "--s3-port" in args:
            i = args.index("--s3-port") + 1
            args[i] = str(self.port(name, svc["command"][i]))
        return [sys.executable, "-m", "services.cli", *args], env


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, LocalCompose]]:
    root = tmp_path_factory.mktemp("compose")
    lc = LocalCompose(compose(), root)
    cluster = Cluster(url=f"http://127.0.0.1:{lc.port('scheduler', 8000)}",
                      log_dir=root / "logs")
    cluster.log_dir.mkdir()
    try:
        argv, env = lc.command("init")
        subprocess.run(argv, env={**env, "PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
                       check=True,
                       cwd=REPO, timeout=120, capture_output=True)
        argv, env = lc.command("s3")
        cluster.spawn("s3", argv, env)
        # (the S3 server admits the pair derived from the secret the init job wrote)
        secret_file = Path(lc.command("scheduler")[1]["OVERTURE_CLUSTER__SECRET_FILE"])
        keys = derive_s3_credentials(InternalAuth(secret_file.read_text().splitlines()[0].strip()))
        spec = S3ServerSpec(root, "127.0.0.1", {"s3": lc.port("s3", 8333)}, keys)
        deadline = time.monotonic() + 60
        while not bucket_ready(spec):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.2)
        for name in ("scheduler", "node1-kvstore", "node2-kvstore", "node1-engine",
                     "node2-engine", "node1-nodemgr", "node2-nodemgr"):
            argv, env = lc.command(name)
            cluster.spawn(name.replace("-", "."), argv, env)
        cluster.wait_ready(2, 180)
        cluster.wait_attached(120)
        yield cluster, lc
    finally:
        cluster.stop()


def _serve_only(cluster: Cluster, node: str) -> None:
    for n in ("node1", "node2"):
        action = "undrain" if n == node else "drain"
        status, _ = cluster.post_as(ADMIN, f"/admin/nodes/{n}/{action}")
        assert status == 200


@pytest.mark.slow
def test_a_chat_with_an_advisory_moves_between_the_compose_nodes(local) -> None:
    cluster, lc = local
    messages = [{"role": "system", "content": "You answer in one line. " * 12},
                {"role": "user", "content": "What is a compose file?"}]
    _serve_only(cluster, "node1")
    status, first, headers = cluster.post_with_headers(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0},
        headers={**KEY, "X-Session-Id": "parity"})
    assert status == 200 and headers["X-Overture-Node"] == "node1", (first, cluster.logs())
    _serve_only(cluster, "node2")
    status, adv, _ = cluster.post_with_headers(
        "/v1/advisory", {"session_id": "parity", "model": first["model"]}, headers=KEY)
    assert status == 202 and adv["node"] == "node2", adv
    time.sleep(1.0)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And why two nodes?"}]
    status, second, headers = cluster.post_with_headers(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0},
        headers={**KEY, "X-Session-Id": "parity"})
    assert status == 200 and headers["X-Overture-Node"] == "node2", (second, cluster.logs())
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, cluster.logs()
    # The compose metrics ports serve too (what the monitoring profile scrapes).
    port = lc.port("node2-engine", 9102)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert b"overture_engine_prompt_tokens_total" in r.read()
