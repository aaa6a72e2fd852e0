"""A local cluster as child processes: free loopback ports, each service's command line
(every service's /metrics on by default, listed for Prometheus by ``write_file_sd``),
and the specs ``overture up`` supervises (a scheduler, then per node a kvstore, an engine
per model and a node manager; with several models, the node's shared device ledger and
the model catalogue).
"""

from __future__ import annotations

import functools
import json
import random
import socket
import sys
import uuid
from pathlib import Path

from services.s3_server import S3ServerSpec, bucket_ready
from services.supervisor import ChildSpec
from shared.config import load_yaml
from shared.cpus import format_cpus
from shared.device_ledger import create_ledger
from shared.model_catalog import ModelEntry, write_catalog

# Ports handed to children come from below the kernel's ephemeral range (32768-60999 on
# Linux): a port picked there can be taken as the source port of some outgoing connection
# before the child binds it.
_PORTS = range(20000, 32000)
_handed_out: set[int] = set()
QUANTIZED = ("q4", "q8_0")  # engine dtypes that keep integer codes, not float tensors


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the child binds it right after), never one this
    process handed out before."""
    for _ in range(64):
        port = random.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # (a crowded range: let the kernel choose)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def service_command(name: str, flags: dict[str, object], config: str | None = None) -> list[str]:
    """``python -m services.<name> --config FILE --flag value ...``"""
    cmd = [sys.executable, "-m", f"services.{name}"]
    if config:
        cmd += ["--config", str(config)]
    for key, value in flags.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def cluster_specs(
    *,
    nodes: int,
    http_port: int,
    model_path: str,
    dtype: str | None,
    config: str | None,
    served_name: str = "",
    more_models: tuple[tuple[str, str], ...] = (),
    ledgers: list[Path] | None = None,
    models_config: str | None = None,
    host: str = "127.0.0.1",
    state_dir: Path | None = None,
    s3: S3ServerSpec | None = None,
    cores: list[tuple[int, ...]] | None = None,
    anonymous: bool = False,
    metrics: bool = True,
    reuse_store: dict[str, object] | None = None,
) -> tuple[list[ChildSpec], str]:
    """Commands for a scheduler plus ``nodes`` nodes; returns them and the public URL.
    With ``state_dir`` each node's kvstore keeps its SSD tier in ``state_dir/<node>/``;
    with ``s3`` that server is started first and every kvstore uses it; with ``cores``
    node i's engine and kvstore run on ``cores[i]`` only; ``anonymous``: the scheduler
    serves without API keys (on loopback). ``more_models`` ((folder, served name) each):
    every node also runs an engine for each, all of a node's engines sharing one device
    budget through its ledger in ``ledgers[i]`` (Prism §5.1). ``metrics``: every service
    serves Prometheus /metrics on a free port of its own (the scheduler on its HTTP port),
    named in its spec and told to the scheduler by each nodemgr (``GET /admin/nodes``).
    ``reuse_store``: every nodemgr's Reuse Store flags (``reuse_store_flags``)."""
    grpc_port = free_port(host)
    specs = []
    if s3 is not None:
        specs.append(ChildSpec("s3", s3.argv(), functools.partial(bucket_ready, s3),
                               stop_last=True))
    specs += [
        ChildSpec(
            "scheduler",
            service_command(
                "scheduler", {"host": host, "port": http_port, "grpc_port": grpc_port,
                              **({"anonymous": "true"} if anonymous else {}),
                              # (routes a catalogue model active nowhere to a node that
                              # activates it, and places models: Prism, Tangram §3.4)
                              **({"models_config": models_config} if models_config else {}),
                              **_scheduler_state(state_dir, s3)}, config
            ),
            metrics=f"{host}:{http_port}" if metrics else "",
        )
    ]
    for i in range(nodes):
        node_id = f"node{i}"
        kv, nm = free_port(host), free_port(host)
        engines: list[str] = []
        kv_flags: dict[str, object] = {"host": host, "port": kv, "node_id": node_id}
        if s3 is not None:
            kv_flags.update(s3.kvstore_flags())
        if cores is not None and cores[i]:
            kv_flags["cpus"] = format_cpus(cores[i])
        if state_dir is not None:
            kv_flags["ssd_path"] = str(state_dir / node_id / "kvstore-ssd")
        targets: dict[str, str] = {}  # service -> host:port of its /metrics
        if metrics:
            kv_flags["metrics_port"] = port = free_port(host)
            targets["kvstore"] = f"{host}:{port}"
        specs.append(ChildSpec(f"{node_id}.kvstore", service_command("kvstore", kv_flags,
                                                                      config),
                               metrics=targets.get("kvstore", "")))
        for j, (path, served) in enumerate(((model_path, served_name), *more_models)):
            eng = free_port(host)
            engines.append(f"{host}:{eng}")
            engine_flags: dict[str, object] = {
                "host": host, "port": eng, "model_path": path,
                "offload.kvstore_address": f"{host}:{kv}",
            }
            if dtype:
                engine_flags["dtype"] = dtype
            if served:
                engine_flags["served_model_name"] = served
            if cores is not None and cores[i]:
                engine_flags["cpus"] = format_cpus(cores[i])
            if ledgers:
                engine_flags["device_ledger"] = str(ledgers[i])
            name = f"{node_id}.engine" + (f"{j}" if j else "")
            if metrics:
                engine_flags["metrics_port"] = port = free_port(host)
                targets[name.split(".", 1)[1]] = f"{host}:{port}"
            specs.append(ChildSpec(name, service_command("engine", engine_flags, config),
                                   metrics=targets.get(name.split(".", 1)[1], "")))
        nm_flags: dict[str, object] = {
            "host": host,
            "port": nm,
            "node_id": node_id,
            "scheduler_address": f"{host}:{grpc_port}",
            "kvstore_address": f"{host}:{kv}",
        }
        if len(engines) == 1:
            nm_flags["engine_address"] = engines[0]
        else:
            nm_flags["engine_addresses"] = ",".join(engines)
        if ledgers:
            nm_flags["device_ledger"] = str(ledgers[i])
        if models_config:
            nm_flags["models_config"] = models_config
            nm_flags.update(reuse_store or {})
        if metrics:
            nm_flags["metrics_targets"] = ",".join(f"{k}={v}" for k, v in targets.items())
            nm_flags["metrics_port"] = port = free_port(host)
        specs.append(ChildSpec(f"{node_id}.nodemgr",
                               service_command("nodemgr", nm_flags, config),
                               metrics=f"{host}:{port}" if metrics else ""))
    return specs, f"http://{host}:{http_port}"


def write_file_sd(specs: list[ChildSpec], path: Path) -> Path:
    """Every child's /metrics as a Prometheus file-based service discovery file
    (``file_sd_configs``: a JSON list of {targets, labels}), written whole then renamed so
    a Prometheus watching it never reads half a file. Labels: ``service`` (scheduler,
    kvstore, engine, nodemgr...) and ``node`` (absent for the scheduler)."""
    groups = []
    for spec in specs:
        if not spec.metrics:
            continue
        node, _, service = spec.name.rpartition(".")
        labels = {"job": "overture", "service": service}
        if node:
            labels["node"] = node
        groups.append({"targets": [spec.metrics], "labels": labels})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=1) + "\n")
    tmp.replace(path)
    return path


def has_catalog(path: str) -> bool:
    """Whether the YAML file lists a model catalogue (``models:``)."""

    return bool(load_yaml(path).get("models"))


def catalog_file(config: str | None, served: list[tuple[str, str]], state_dir: Path) -> str:
    """The model catalogue of a local cluster: the config's ``models:`` list when it has
    one, else the served (folder, name) pairs with the default SLOs, written to
    ``state_dir/models.yaml``."""

    if config and has_catalog(config):
        return config
    state_dir.mkdir(parents=True, exist_ok=True)
    return str(write_catalog(state_dir / "models.yaml",
                             [ModelEntry(name, path) for path, name in served]))


def reuse_store_flags(dtype: str, node_memory: int, config: str | None
                      ) -> tuple[dict[str, object], str]:
    """The nodemgr flags that turn the Reuse Store on for a node with a catalogue (it may
    serve more than one model), and a line saying why or why not. Sized to the node's device
    budget: the arena is sparse (pages are committed only for resident tensors) and those
    count in the node's ledger, so the cap never lets weights hold more than the node has,
    and KV takes memory back by the broker's rules (Tangram §3.3). Off for a quantized
    engine (q4 / q8_0 keep their own integer codes; the store holds float tensors), and
    left to the YAML file when it sets ``nodemgr.reuse_store_bytes`` itself."""
    section = (load_yaml(config).get("nodemgr") or {}) if config else {}
    if isinstance(section, dict) and "reuse_store_bytes" in section:
        return {}, "Reuse Store: as nodemgr.reuse_store_bytes in the config says"
    if dtype in QUANTIZED:
        return {}, (f"Reuse Store: off (the engines serve {dtype} weights; the store holds "
                    "float tensors)")
    return ({"reuse_store_bytes": node_memory, "weights_dtype": dtype},
            f"Reuse Store: on, up to {node_memory >> 20} MiB of {dtype} weights a node, "
            "shared across models and kept resident after eviction")


def node_ledgers(nodes: int, budget_bytes: int) -> list[Path]:
    """A fresh device ledger per node (in shared memory), for its engines to share."""

    tag = uuid.uuid4().hex[:8]
    return [create_ledger(Path("/dev/shm") / f"overture-ledger-node{i}-{tag}", budget_bytes)
            for i in range(nodes)]


def _scheduler_state(state_dir: Path | None, s3: S3ServerSpec | None) -> dict[str, object]:
    """Where the scheduler keeps what must outlive it (stored responses): the cluster's S3
    bucket when there is one, its own folder beside the nodes' otherwise."""
    flags: dict[str, object] = {}
    if state_dir is not None:
        flags["state_dir"] = str(state_dir / "scheduler")
    if s3 is not None:
        flags.update(s3.kvstore_flags())
    return flags
